"""A refit end to end, on both stores: PENDING → PREPARING → TRANSFERRING → VERIFYING →
COMMITTED with simulated agents; versions, bytes, timings, epochs and plan reuse."""

from __future__ import annotations

import pytest

from refitplane.protocol import Backend, MemberState, RefitState, Role
from refitplane.protocol.messages import (
    CreateRendezvousCmd,
    JoinGroupCmd,
    PrepareRefitCmd,
    StartTransferCmd,
)

pytestmark = pytest.mark.integration


def test_refit_commits_and_next_refit_reuses_group_and_plan(
    store_url, coordinator_factory, sim_cluster
):
    coord = coordinator_factory(store_url)
    cluster = sim_cluster(coord)
    trainers = cluster.trainers(world=2)
    with_sidecar = cluster.replica("r-a", world=2, sidecar=True)
    without_sidecar = cluster.replica("r-b", world=1)
    client = cluster.client()

    first = client.trigger("job", idempotency_key="step-1")
    assert first.state is RefitState.PENDING
    assert first.version == 1
    done = client.wait(first.refit_id, timeout_s=15)
    assert done.state is RefitState.COMMITTED, (done.reason, done.message)
    assert done.target_replicas == ["r-a", "r-b"]
    # Each of the two replicas needs both tensors in full: 16*8*2 + 8*4 bytes each.
    assert done.bytes_total == 2 * (16 * 8 * 2 + 8 * 4)
    assert done.bytes_done == done.bytes_total
    assert done.tensors_total == done.tensors_verified == 2 * 2 + 2  # per receiving rank
    phases = [t.phase for t in done.timings]
    assert phases == [
        RefitState.PENDING,
        RefitState.PREPARING,
        RefitState.TRANSFERRING,
        RefitState.VERIFYING,
    ]
    assert all(t.seconds >= 0 for t in done.timings)
    assert done.group_epoch == 1
    assert done.plan_digest

    # Group: trainers are ranks 0-1, then r-a (2-3), then r-b (4); rank 0 made the rendezvous.
    ranks = {m.member_id: m.agent.group_rank for m in cluster.members if m.agent.group_rank >= 0}
    assert [ranks[m.member_id] for m in trainers + with_sidecar[:2] + without_sidecar] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert len(trainers[0].agent.received(CreateRendezvousCmd)) == 1
    assert not trainers[1].agent.received(CreateRendezvousCmd)
    rendezvous = trainers[1].agent.received(JoinGroupCmd)[0]
    assert rendezvous.backend is Backend.GLOO
    assert rendezvous.group_size == 5

    # Data-plane ranks got a plan and the transfer config; the sidecar got the pause mode.
    prepare = with_sidecar[0].agent.received(PrepareRefitCmd)[0]
    assert prepare.plan is not None
    assert prepare.plan.rank == 2
    assert prepare.config is not None
    assert prepare.config.num_channels == 2
    sidecar_prepare = with_sidecar[2].agent.received(PrepareRefitCmd)[0]
    assert sidecar_prepare.plan is None
    assert sidecar_prepare.pause_mode == "keep"
    assert with_sidecar[2].agent.received(StartTransferCmd)

    topo = client.topology("job")
    assert topo.committed_version == 1
    assert topo.healthy
    assert {r.replica_id: r.version for r in topo.replicas} == {"r-a": 1, "r-b": 1}
    assert all(r.state is MemberState.READY for r in topo.replicas)
    assert topo.group_epoch == 1
    assert topo.group_size == 5
    assert topo.backend is Backend.GLOO

    # Same members, same layouts: no new epoch, the cached plan, version 2.
    second = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert second.state is RefitState.COMMITTED
    assert second.version == 2
    assert second.group_epoch == 1
    assert second.plan_digest == done.plan_digest
    assert len(trainers[0].agent.received(CreateRendezvousCmd)) == 1
    assert coord.core.plans.hits >= 1
    assert coord.core.plans.misses == 1
    assert client.topology("job").committed_version == 2
    assert [r.version for r in client.list("job")] == [2, 1]


def test_target_subset_updates_only_that_replica(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    a = cluster.replica("a")
    b = cluster.replica("b")
    client = cluster.client()
    refit = client.wait(client.trigger("job", target_replicas=["b"]).refit_id, timeout_s=15)
    assert refit.state is RefitState.COMMITTED
    assert refit.target_replicas == ["b"]
    assert not a[0].agent.received(PrepareRefitCmd)
    assert b[0].agent.received(PrepareRefitCmd)
    # The group still holds every complete replica, so a later refit of "a" needs no epoch.
    assert a[0].agent.group_rank == 1
    assert b[0].agent.group_rank == 2
    versions = {r.replica_id: r.version for r in client.topology("job").replicas}
    assert versions == {"a": 0, "b": 1}


def test_membership_change_starts_new_epoch_and_old_members_leave(coordinator, sim_cluster):
    from refitplane.protocol.messages import LeaveGroupCmd

    cluster = sim_cluster(coordinator)
    trainers = cluster.trainers(world=1)
    cluster.replica("a")
    client = cluster.client()
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).group_epoch == 1
    cluster.replica("b")
    refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert refit.state is RefitState.COMMITTED
    assert refit.group_epoch == 2
    leaves = trainers[0].agent.received(LeaveGroupCmd)
    assert [(c.epoch, c.abort) for c in leaves] == [(1, True)]
    assert trainers[0].agent.epoch == 2


def test_sidecar_only_counts_when_it_reports_the_version(coordinator_factory, sim_cluster):
    from refitplane.agent.simulated import Behaviour

    cluster = sim_cluster(coordinator_factory(verify_timeout_s=1))
    cluster.trainers(world=1)
    cluster.replica("a")
    cluster.add(
        Role.GENERATOR_SIDECAR,
        replica="a",
        device="",
        behaviour=Behaviour(silent=frozenset({"start_transfer"})),
    )
    client = cluster.client()
    refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert refit.state is RefitState.FAILED
    assert refit.reason == "TIMEOUT"
    assert "VERIFYING" in refit.message
    assert "'a'" in refit.message
    # It failed after StartTransfer: the replica must not serve until a later commit.
    replica = client.topology("job").replicas[0]
    assert replica.state is MemberState.DEGRADED
    assert replica.version == 0
