"""vLLM plugin entry point (`vllm.general_plugins` → `refitplane`): the backend "refitplane"
on both sides of vLLM's weight-transfer API.

- worker side: `WeightTransferEngineFactory` → `refitplane.generator.vllm_engine.
  RefitplaneEngine` (each vLLM worker becomes a generator rank); building it wraps the
  worker's `sleep` / `discard` (`vllm_sleep_guard`), so weights vLLM discards (sleep
  level 2) are never reported as a version;
- trainer side: `WeightTransferTrainerFactory` (vLLM >= 0.28) → `refitplane.trainer.
  vllm_engine.RefitplaneTrainerEngine`, so `WeightTransferTrainerFactory.trainer_init(...)`
  and vLLM's HTTP / Ray weight-sync clients drive refitplane refits;
- API process: `vllm_api_guard.install()` makes the HTTP verbs (and `LLM` / `AsyncLLM`
  methods) answer with the right status and never set an unverified weight version.

vLLM runs general plugins in every process it starts (API server, engine core, workers), so
registration happens wherever an engine is built. A trainer process that never builds a
vLLM engine does not load plugins by itself: importing `refitplane.trainer.vllm_engine`
registers the backend (`refitplane.replica.vllm_backend`, which both roles share), as vLLM's
own docs ask of out-of-tree trainer engines. Registration is lazy (module path + class name)
and idempotent (`register_engine` raises on a second registration of a name). A plugin that
raises is only logged by vLLM, so a broken install shows up as "unknown backend" later:
errors are logged here, loudly, with the reason.
"""

from __future__ import annotations

import logging

from refitplane.replica import vllm_backend

log = logging.getLogger("refitplane.generator.plugin")

BACKEND_NAME = vllm_backend.BACKEND_NAME


def register() -> None:
    if not vllm_backend.register():
        return
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
