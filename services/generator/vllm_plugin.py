"""vLLM plugin entry point (`vllm.general_plugins` → `refitplane`): registers the
refitplane weight-transfer engine under the backend name "refitplane".

vLLM runs general plugins in every process it starts (API server, engine core, workers), so
registration happens wherever the engine is built; it is lazy (module path + class name)
and idempotent (`register_engine` raises on a second registration of a name). A plugin that
raises is only logged by vLLM, so a broken install shows up as "unknown backend" later:
the error is logged here, loudly, with the reason.
"""

from __future__ import annotations

import logging

log = logging.getLogger("refitplane.generator.plugin")

BACKEND_NAME = "refitplane"
ENGINE_MODULE = "refitplane.generator.vllm_engine"
ENGINE_CLASS = "RefitplaneEngine"


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        log.error("refitplane: this vLLM has no weight_transfer API (needs vLLM >= 0.26)")
        return
    registry = getattr(WeightTransferEngineFactory, "_registry", None)
    if isinstance(registry, dict) and BACKEND_NAME in registry:
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError as exc:  # registered meanwhile, or a name clash
        if "already" not in str(exc).lower():
            log.error("refitplane: could not register the %r engine: %s", BACKEND_NAME, exc)
