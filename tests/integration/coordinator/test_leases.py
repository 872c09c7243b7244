"""Leases: an expired lease marks the member LOST and fails the refit that needs it; a lost
member must register again (RenewLease answers NOT_FOUND), which the agent session does."""

from __future__ import annotations

import time

import grpc
import pytest

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane.agent.simulated import Behaviour
from refitplane.protocol import MemberState, RefitState, Role
from tests.integration.conftest import row_layout, wait_until

pytestmark = pytest.mark.integration


def test_expired_lease_fails_refit_naming_member(store_url, coordinator_factory, sim_cluster):
    coord = coordinator_factory(store_url, lease_ttl_s=2.0)
    cluster = sim_cluster(coord)
    cluster.trainers(world=1, behaviour=Behaviour(hold_transfer_s=30))
    gen = cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
    client = cluster.client()
    refit = client.trigger("job")
    wait_until(lambda: client.get(refit.refit_id).state is RefitState.TRANSFERRING, what="transfer")
    # The generator's process "dies": its threads stop, nothing renews its lease.
    gen.session.close(deregister=False)
    final = client.wait(refit.refit_id, timeout_s=10)
    assert final.state is RefitState.FAILED
    assert final.reason == "LEASE_EXPIRED"
    assert gen.member_id in final.message
    assert "lease expired" in final.message
    member = next(m for m in client.topology("job").members if m.member_id == gen.member_id)
    assert member.state is MemberState.LOST

    # A lost member cannot renew: it must register again.
    channel = grpc.insecure_channel(coord.grpc_target)
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.RenewLease(
            apb.RenewLeaseRequest(member_id=gen.member_id),
            timeout=5,
            metadata=gen.session.metadata,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


def test_session_reregisters_after_losing_its_lease(coordinator_factory, sim_cluster):
    coord = coordinator_factory(lease_ttl_s=3.0)
    cluster = sim_cluster(coord)
    trainers = cluster.trainers(world=1)
    gens = cluster.replica("a")
    client = cluster.client()
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).group_epoch == 1
    old_ids = {m.member_id for m in cluster.members}

    # Expire every lease at once (as if the agents had been partitioned away for a TTL).
    lost = coord.call(coord.core.membership.expire(now=time.time() + 60))
    assert {m.member_id for m in lost} == old_ids
    wait_until(
        lambda: all(m.session.registrations == 2 for m in cluster.members),
        timeout_s=10,
        what="re-registration",
    )
    new_ids = {m.member_id for m in cluster.members}
    assert not new_ids & old_ids
    # Layouts were published again under the new ids, so the next refit just works.
    refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert refit.state is RefitState.COMMITTED, refit.message
    assert refit.group_epoch == 2
    assert trainers[0].agent.epoch == 2
    assert gens[0].agent.epoch == 2


def test_reregistering_same_key_replaces_member(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    first = cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
    client = cluster.client()
    client.wait(client.trigger("job").refit_id, timeout_s=15)
    # The generator's process restarts: the new one registers under the same key.
    first.session.close(deregister=False)
    second = cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
    members = client.topology("job").members
    ids = {m.member_id for m in members}
    assert second.member_id in ids
    assert first.member_id not in ids
    refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert refit.state is RefitState.COMMITTED
    assert refit.group_epoch == 2
