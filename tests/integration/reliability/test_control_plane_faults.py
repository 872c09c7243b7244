"""Faults of the control plane, with every part a real process: the coordinator is SIGKILLed
and restarted on the same Redis; Redis (AOF, fsync always) is SIGKILLed and restarted, idle
and in the middle of a refit. Two trainer ranks and one generator replica move real bytes.

Expected: a refit in flight when the coordinator dies is failed cleanly by the next one
(COORDINATOR_RESTARTED; its participants are told to abort when their streams reconnect),
a queued refit resumes and commits; nothing registered is lost (members keep their ids and
never register again). Members, versions and refit records survive a Redis crash; while
Redis is away the coordinator answers UNAVAILABLE / 503 and `/readyz` fails; a refit caught
by the outage ends (committed, or failed with a reason), never hangs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from refitplane.errors import Unavailable
from refitplane.protocol import RefitState
from refitplane.testing.cluster.processes import wait_for
from tests.integration.reliability.conftest import start_world
from tests.integration.reliability.support import World, note

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = start_world(tmp_path_factory.mktemp("control-plane"), trainers=2, replicas={"rep-0": 1})
    try:
        yield w
    finally:
        w.cluster.close()


def _members(world: World) -> dict[str, tuple[str, int]]:
    return {
        a.name: (a.status()["member_id"], a.status()["registrations"]) for a in world.live_agents()
    }


def _readyz(world: World) -> int:
    try:
        return httpx.get(f"{world.cluster.coordinator.http_url}/readyz", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_coordinator_killed_mid_refit_and_restarted(world: World) -> None:
    cluster = world.cluster
    members = _members(world)
    version = world.next_version()
    world.step(version)
    for trainer in cluster.trainers:
        trainer.arm(stall_after_bytes=0, stall_until="abort")
    running = world.trigger(version)
    cluster.wait_state(running.refit_id, RefitState.TRANSFERRING)
    queued = world.trigger(world.next_version())

    cluster.coordinator.kill()
    time.sleep(1.0)  # the agents live on without it
    assert all(a.alive() for a in cluster.agents.values())
    cluster.coordinator.start()

    failed = cluster.wait(running.refit_id, timeout_s=30)
    assert failed.state is RefitState.FAILED
    assert failed.reason == "COORDINATOR_RESTARTED"
    assert "TRANSFERRING" in failed.message
    # Participants hear the abort once their command streams reconnect: the stalled
    # trainers return, every rank records the end of that transfer.
    for agent in cluster.agents.values():
        cluster.wait_outcome(agent, running.refit_id, timeout_s=15)
    resumed = cluster.wait(queued.refit_id, timeout_s=60)
    assert resumed.state is RefitState.COMMITTED, (resumed.reason, resumed.message)
    assert resumed.group_epoch > failed.group_epoch
    world.check_holds(queued.version, weights=version)
    # Nothing registered was lost: same members, never registered again.
    assert _members(world) == members
    world.check_released(failed)
    note("coordinator killed", running=failed.reason, queued=resumed.state.value,
         members_kept=len(members))  # fmt: skip


def test_redis_crash_keeps_members_versions_and_refits(world: World) -> None:
    cluster = world.cluster
    assert cluster.redis is not None
    members = _members(world)
    with cluster.client() as client:
        refits = [(r.refit_id, r.state) for r in client.list(cluster.job, limit=100)]
    committed = cluster.topology().committed_version

    cluster.redis.kill()
    wait_for("/readyz to fail", lambda: _readyz(world) == 503, 15)
    with pytest.raises(Unavailable), cluster.client() as client:
        client.trigger(cluster.job)
    response = httpx.post(f"{cluster.coordinator.http_url}/v1/jobs/{cluster.job}/refits")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["reason"] == "UNAVAILABLE"

    cluster.redis.start()
    wait_for("/readyz to pass", lambda: _readyz(world) == 200, 15)
    # Proof that it is Redis that kept it, not the coordinator's memory: crash that too.
    cluster.coordinator.kill()
    cluster.coordinator.start()
    topo = cluster.topology()
    assert topo.committed_version == committed == world.committed
    assert {m.member_id for m in topo.members} == {m for m, _ in members.values()}
    assert {r.version for r in topo.replicas} == {world.committed}
    with cluster.client() as client:
        assert [(r.refit_id, r.state) for r in client.list(cluster.job, limit=100)] == refits
    assert _members(world) == members  # the agents never had to register again
    world.commit()
    note("redis crash idle", refits_kept=len(refits), members_kept=len(members),
         committed_version=committed)  # fmt: skip


@pytest.mark.parametrize("outage_s", [1.0, 6.0])
def test_redis_crash_mid_refit_ends_the_refit_cleanly(world: World, outage_s: float) -> None:
    """The transfer takes ~2 s (a slow trainer); Redis dies as it starts. A short outage is
    ridden out; a long one fails the refit with STORE_UNAVAILABLE, persisted once Redis is
    back. Either way the refit ends, and the next one commits."""
    cluster = world.cluster
    assert cluster.redis is not None
    version = world.next_version()
    world.step(version)
    cluster.agents["trainer-0"].arm(delay_s=2.0)
    refit = world.trigger(version)
    cluster.wait_state(refit.refit_id, RefitState.TRANSFERRING)
    cluster.redis.kill()
    time.sleep(outage_s)
    cluster.redis.start()
    final = cluster.wait(refit.refit_id, timeout_s=60)
    if outage_s > 5:
        assert final.state is RefitState.FAILED
        assert final.reason == "STORE_UNAVAILABLE", (final.reason, final.message)
    if final.state is RefitState.COMMITTED:
        world.check_holds(version)
    else:
        assert final.state is RefitState.FAILED
        assert final.reason == "STORE_UNAVAILABLE", (final.reason, final.message)
        world.check_released(final)
        world.policies(final)
        # What clients read is the persisted record.
        cluster.coordinator.kill()
        cluster.coordinator.start()
        with cluster.client() as client:
            assert client.get(refit.refit_id).state is RefitState.FAILED
    world.commit()
    note(f"redis crash mid-refit ({outage_s:g} s)", state=final.state.value, reason=final.reason)
