"""The backend "refitplane" of vLLM's weight-transfer API, on both of vLLM's factories:
`WeightTransferEngineFactory` (each vLLM worker becomes a generator rank) and
`WeightTransferTrainerFactory` (vLLM >= 0.28: trainer ranks send through it). Registration
is lazy (module path + class name: nothing of either role is imported here) and idempotent.
The generator's plugin entry point and the trainer's vLLM-API engine both call `register`."""

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


def register() -> bool:
    """Make the backend known to vLLM's factories; False when this vLLM has no
    weight-transfer API (logged)."""
    try:
        from vllm.distributed.weight_transfer import factory
    except ImportError:
        log.error("refitplane: this vLLM has no weight_transfer API (needs vLLM >= 0.26)")
        return False
    _register_once(factory.WeightTransferEngineFactory, ENGINE_MODULE, ENGINE_CLASS)
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainer_factory is not None:  # vLLM 0.26 has no trainer-side registry
        _register_once(trainer_factory, TRAINER_MODULE, TRAINER_CLASS)
    return True
