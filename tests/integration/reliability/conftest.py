"""Fixtures of the reliability suite: a job of real processes (redis-server with AOF, the
coordinator process, trainer and generator ranks from `refitplane.testing.cluster.agent_procs`).

One cluster per test module (starting a rank costs a torch import); every test leaves it
healthy — the last thing each fault test does is a refit that must commit — and the
autouse `healthy` fixture restarts anything a failed test left dead, so one failure does
not cascade.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from refitplane.testing.cluster.proc_cluster import ProcCluster
from tests.integration.reliability.support import World

# Timeouts of the fault modules (seconds): short, so every failure ends fast, yet far above
# what a refit of the synthetic model takes (~0.1 s).
LEASE_TTL_S = 3.0
PREPARE_TIMEOUT_S = 4.0
TRANSFER_TIMEOUT_S = 5.0
FAULT_ENV = {
    "REFIT_LEASE_TTL_S": str(LEASE_TTL_S),
    "REFIT_PREPARE_TIMEOUT_S": str(PREPARE_TIMEOUT_S),
    "REFIT_TRANSFER_TIMEOUT_S": str(TRANSFER_TIMEOUT_S),
    "REFIT_GROUP_TIMEOUT_S": "8",
    "REFIT_VERIFY_TIMEOUT_S": "5",
}
# Slack for process scheduling on a loaded 2-core CI machine.
SLACK_S = 4.0


def start_world(
    workdir: Path, *, trainers: int, replicas: dict[str, int], env: dict[str, str] | None = None
) -> World:
    cluster = ProcCluster(workdir, coordinator_env={**FAULT_ENV, **(env or {})})
    try:
        cluster.start()
        cluster.add_trainers(trainers)
        for replica, tp in replicas.items():
            cluster.add_replica(replica, tp)
        cluster.wait_ready()
        world = World(cluster)
        world.commit()  # forms the group epoch, plans, and checks the starting point
    except BaseException:
        cluster.close()
        raise
    return world


def keep_healthy(world: World) -> None:
    """Restart whatever a previous test left dead, and commit once if it was needed."""
    cluster = world.cluster
    restarted = False
    if cluster.redis is not None and not cluster.redis.alive():
        cluster.redis.start()
        restarted = True
    if not cluster.coordinator.alive():
        cluster.coordinator.start()
        restarted = True
    for agent in cluster.agents.values():
        agent.thaw()
        if not agent.alive():
            version = world.trainer_weights if agent.role == "trainer" else None
            cluster.restart_agent(agent.name, version=version)
            restarted = True
    if restarted:
        cluster.wait_ready()
        world.commit()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = start_world(
        tmp_path_factory.mktemp("reliability"), trainers=2, replicas={"rep-0": 2, "rep-1": 1}
    )
    try:
        yield w
    finally:
        w.cluster.close()


@pytest.fixture(autouse=True)
def healthy(request: pytest.FixtureRequest) -> None:
    if "world" in request.fixturenames:
        keep_healthy(request.getfixturevalue("world"))
