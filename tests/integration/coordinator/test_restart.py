"""Coordinator restarts on the same Redis: state reloads, members keep their ids, refits in
flight fail with COORDINATOR_RESTARTED (participants get AbortRefit when their streams
reconnect), pending refits resume. Also: the state survives a Redis restart (AOF)."""

from __future__ import annotations

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.errors import Unavailable
from refitplane.protocol import RefitState
from refitplane.protocol.messages import AbortRefitCmd
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def _aborts(member, refit_id):
    return [c for c in member.agent.received(AbortRefitCmd) if c.refit_id == refit_id]


def test_restart_mid_refit_fails_it_and_resumes_pending(
    redis_url, coordinator_factory, sim_cluster
):
    first = coordinator_factory(redis_url)
    cluster = sim_cluster(first)
    cluster.trainers(world=2, behaviour=Behaviour(hold_transfer_s=30))
    cluster.replica("a", sidecar=True)
    client = cluster.client()
    running = client.trigger("job")
    wait_until(lambda: client.get(running.refit_id).state is RefitState.TRANSFERRING, what="run")
    queued = client.trigger("job")
    ids_before = {m.member_id for m in cluster.members}

    first.stop(graceful=False)  # like a crash: nothing is cleaned up
    for m in cluster.members:
        m.agent.behaviour = Behaviour()
    second = coordinator_factory(redis_url, grpc_port=first.server.grpc_port)

    failed = client.wait(running.refit_id, timeout_s=20)
    assert failed.state is RefitState.FAILED
    assert failed.reason == "COORDINATOR_RESTARTED"
    assert "TRANSFERRING" in failed.message
    resumed = client.wait(queued.refit_id, timeout_s=20)
    assert resumed.state is RefitState.COMMITTED, resumed.message
    assert resumed.version == 2
    assert resumed.group_epoch == 2
    # Nobody had to register again; everyone heard about the aborted refit.
    assert {m.member_id for m in cluster.members} == ids_before
    assert all(m.session.registrations == 1 for m in cluster.members)
    for m in cluster.members:
        wait_until(lambda m=m: _aborts(m, running.refit_id), what="abort after reconnect")
    assert client.topology("job").committed_version == 2
    assert second.core.membership.find(cluster.members[0].member_id) is not None


def test_graceful_stop_aborts_refit_in_flight(redis_url, coordinator_process, sim_cluster):
    proc = coordinator_process(env={"REFIT_REDIS_URL": redis_url, "REFIT_LEASE_TTL_S": "5"})
    cluster = sim_cluster(proc)
    cluster.trainers(world=1, behaviour=Behaviour(hold_transfer_s=30))
    cluster.replica("a")
    client = cluster.client()
    refit = client.trigger("job")
    wait_until(lambda: client.get(refit.refit_id).state is RefitState.TRANSFERRING, what="run")
    assert proc.terminate() == 0
    # Participants were told before the streams closed.
    for m in cluster.members:
        wait_until(lambda m=m: _aborts(m, refit.refit_id), what="abort")
    restarted = coordinator_process(
        "--grpc-port", str(proc.grpc_port), env={"REFIT_REDIS_URL": redis_url}
    )
    record = cluster.client().get(refit.refit_id)
    assert record.state is RefitState.FAILED
    assert record.reason == "COORDINATOR_RESTARTED"
    restarted.terminate()


def test_state_survives_redis_restart(redis_factory, coordinator_factory, sim_cluster):
    redis = redis_factory(appendonly=True)
    coord = coordinator_factory(redis.url)
    cluster = sim_cluster(coord)
    cluster.trainers(world=1)
    cluster.replica("a")
    client = cluster.client()
    done = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert done.state is RefitState.COMMITTED

    redis.stop()
    with pytest.raises(Unavailable):
        client.list("job")
    redis.start()
    wait_until(lambda: _lists(client), timeout_s=10, what="store back")
    assert client.get(done.refit_id).state is RefitState.COMMITTED
    # A fresh coordinator on the restarted Redis sees members, versions and refits.
    coord.stop(graceful=False)
    again = coordinator_factory(redis.url, grpc_port=coord.server.grpc_port)
    topo = client.topology("job")
    assert topo.committed_version == 1
    assert len(topo.members) == 2
    assert {m.member_id for m in cluster.members} == {m.member_id for m in topo.members}
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).version == 2
    assert again.core.store.kind == "redis"


def _lists(client) -> bool:
    try:
        client.list("job")
    except Unavailable:
        return False
    return True


def test_every_member_of_a_replica_is_stored_at_the_committed_version(
    redis_url, coordinator_factory, sim_cluster
):
    """A replica's members take a refit's version together (their writes in flight at once,
    `Membership.update_all`): the store, read back from Redis, holds each of them at it, and
    a coordinator restarted on it shows them there."""
    first = coordinator_factory(redis_url)
    cluster = sim_cluster(first)
    cluster.trainers(world=1)
    replica = [*cluster.replica("a", world=3), *cluster.replica("b", sidecar=True)]
    client = cluster.client()
    refit = client.wait(client.trigger("job").refit_id, timeout_s=20)
    assert refit.state is RefitState.COMMITTED, refit.message
    stored = {m.member_id: m for m in first.call(first.core.store.load_members())}
    assert {m.member_id: stored[m.member_id].version for m in replica} == {
        m.member_id: refit.version for m in replica
    }
    first.stop(graceful=False)
    second = coordinator_factory(redis_url, grpc_port=first.server.grpc_port)
    for m in replica:
        assert second.core.membership.find(m.member_id).version == refit.version
