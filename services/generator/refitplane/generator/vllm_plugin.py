"""vLLM plugin entry point (`vllm.general_plugins` → `refitplane`): the backend "refitplane"
on both sides of vLLM's weight-transfer API.

- worker side: `WeightTransferEngineFactory` → `refitplane.generator.vllm_engine.
  RefitplaneEngine` (each vLLM worker becomes a generator rank);
- trainer side: `WeightTransferTrainerFactory` (vLLM >= 0.28) → `refitplane.trainer.
  vllm_engine.RefitplaneTrainerEngine`, so `WeightTransferTrainerFactory.trainer_init(...)`
  and vLLM's HTTP / Ray weight-sync clients drive refitplane refits;
- API process: `vllm_api_guard.install()` makes the HTTP verbs (and `LLM` / `AsyncLLM`
  methods) answer with the right status and never set an unverified weight version.

vLLM runs general plugins in every process it starts (API server, engine core, workers), so
registration happens wherever an engine is built. A trainer process that never builds a
vLLM engine does not load plugins by itself: it calls `register()` (importing
`refitplane.trainer.vllm_engine` does), as vLLM's own docs ask of out-of-tree trainer
engines. Registration is lazy (module path + class name) and idempotent (`register_engine`
raises on a second registration of a name). A plugin that raises is only logged by vLLM,
so a broken install shows up as "unknown backend" later: errors are logged here, loudly,
with the reason.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("refitplane.generator.plugin")

BACKEND_NAME = "refitplane"
ENGINE_MODULE = "refitplane.generator.vllm_engine"
ENGINE_CLASS = "RefitplaneEngine"
TRAINER_MODULE = "refitplane.trainer.vllm_engine"
TRAINER_CLASS = "RefitplaneTrainerEngine"


def _register_once(factory: Any, module: str, cls: str) -> None:
    registry = getattr(factory, "_registry", None)
    if isinstance(registry, dict) and BACKEND_NAME in registry:
        return
    try:
        factory.register_engine(BACKEND_NAME, module, cls)
    except ValueError as exc:  # registered meanwhile, or a name clash
        if "already" not in str(exc).lower():
            log.error("refitplane: could not register %s with %s: %s", cls, factory.__name__, exc)


def register() -> None:
    try:
        from vllm.distributed.weight_transfer import factory
    except ImportError:
        log.error("refitplane: this vLLM has no weight_transfer API (needs vLLM >= 0.26)")
        return
    _register_once(factory.WeightTransferEngineFactory, ENGINE_MODULE, ENGINE_CLASS)
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainer_factory is not None:  # vLLM 0.26 has no trainer-side registry
        _register_once(trainer_factory, TRAINER_MODULE, TRAINER_CLASS)
    try:
        # The guard wraps the 0.32 layout of vLLM's RL entry points (absent in 0.26).
        from vllm.entrypoints.rl.offline import RLOfflineMixin  # noqa: F401
    except ImportError:
        log.info("refitplane: vLLM's RL entry points predate 0.32; API guard not installed")
        return
    try:
        from refitplane.generator import vllm_api_guard

        vllm_api_guard.install()
    except Exception:  # a plugin must not stop vLLM; say why the verbs are unguarded
        log.exception("refitplane: the API guard could not be installed")
