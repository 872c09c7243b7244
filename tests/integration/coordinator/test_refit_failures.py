"""How refits fail: agent failures, timeouts, unserviceable layouts, topology problems.
Each ends FAILED with a machine-readable reason and a message naming what is at fault, and
the next refit recovers (new epoch, degraded replicas repaired)."""

from __future__ import annotations

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.protocol import MemberState, RefitState, Role
from refitplane.protocol.messages import (
    AbortRefitCmd,
    CreateRendezvousCmd,
    JoinGroupCmd,
    PrepareRefitCmd,
    StartTransferCmd,
)
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from tests.integration.conftest import row_layout, wait_until

pytestmark = pytest.mark.integration


def _wait(client, refit_id):
    return client.wait(refit_id, timeout_s=20)


def test_agent_failure_fails_refit_aborts_everyone_and_next_refit_recovers(
    store_url, coordinator_factory, sim_cluster
):
    coord = coordinator_factory(store_url)
    cluster = sim_cluster(coord)
    trainers = cluster.trainers(world=2)
    failing = Behaviour(fail={"start_transfer": ("PEER_FAILED", "rank 1 vanished", True)})
    gen = cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1), behaviour=failing)
    client = cluster.client()

    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.state is RefitState.FAILED
    assert refit.reason == "PEER_FAILED"
    assert "replica 'a' rank 0" in refit.message
    assert "rank 1 vanished" in refit.message
    # Every participant gets AbortRefit, at once (stream thread) and in order (worker).
    for m in [*trainers, gen]:
        wait_until(lambda m=m: m.agent.received(AbortRefitCmd), what="AbortRefit")
        assert any(isinstance(c, AbortRefitCmd) for c in m.agent.aborted_now)
    topo = client.topology("job")
    assert topo.replicas[0].state is MemberState.DEGRADED
    assert not topo.healthy
    assert topo.committed_version == 0

    # The group is poisoned: the next refit forms epoch 2 and, now working, repairs "a".
    gen.agent.behaviour = Behaviour()
    retry = _wait(client, client.trigger("job").refit_id)
    assert retry.state is RefitState.COMMITTED, retry.message
    assert retry.group_epoch == 2
    assert len(trainers[0].agent.received(CreateRendezvousCmd)) == 2
    topo = client.topology("job")
    assert topo.replicas[0].state is MemberState.READY
    assert topo.replicas[0].version == 2
    assert topo.healthy


def test_prepare_timeout_names_the_silent_member(coordinator_factory, sim_cluster):
    coord = coordinator_factory(prepare_timeout_s=0.5)
    cluster = sim_cluster(coord)
    cluster.trainers(world=1)
    silent = cluster.add(
        Role.GENERATOR,
        replica="a",
        layout=row_layout(0, 1),
        behaviour=Behaviour(silent=frozenset({"prepare_refit"})),
    )
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.state is RefitState.FAILED
    assert refit.reason == "TIMEOUT"
    assert "PREPARING" in refit.message
    assert silent.member_id in refit.message
    # Nothing moved: StartTransfer never went out, so the replica is not degraded.
    assert not silent.agent.received(StartTransferCmd)
    assert client.topology("job").replicas[0].state is MemberState.READY


def test_transfer_timeout(coordinator_factory, sim_cluster):
    cluster = sim_cluster(coordinator_factory(transfer_timeout_s=0.5))
    cluster.trainers(world=1, behaviour=Behaviour(silent=frozenset({"start_transfer"})))
    cluster.replica("a")
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "TIMEOUT"
    assert "TRANSFERRING" in refit.message
    assert client.topology("job").replicas[0].state is MemberState.DEGRADED


def test_group_formation_failure_then_retry_with_new_epoch(coordinator_factory, sim_cluster):
    cluster = sim_cluster(coordinator_factory(group_timeout_s=0.5))
    trainers = cluster.trainers(
        world=1, behaviour=Behaviour(silent=frozenset({"create_rendezvous"}))
    )
    gens = cluster.replica("a")
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.state is RefitState.FAILED
    assert refit.reason == "GROUP_FAILED"
    assert "rendezvous" in refit.message
    assert trainers[0].member_id in refit.message
    # No refit command went out, so no replica is degraded.
    assert not gens[0].agent.received(PrepareRefitCmd)
    assert client.topology("job").replicas[0].state is MemberState.READY

    trainers[0].agent.behaviour = Behaviour()
    retry = _wait(client, client.trigger("job").refit_id)
    assert retry.state is RefitState.COMMITTED
    assert retry.group_epoch == 2


def test_group_join_failure_report(coordinator_factory, sim_cluster):
    cluster = sim_cluster(coordinator_factory())
    cluster.trainers(world=1)
    cluster.replica(
        "a", behaviour=Behaviour(fail={"join_group": ("NCCL_ERROR", "unhandled cuda error", False)})
    )
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "GROUP_FAILED"
    assert "NCCL_ERROR" in refit.message
    assert "unhandled cuda error" in refit.message


def _layout(name: str, shape: tuple[int, ...], dtype: str, rank: int, box) -> object:
    b = LayoutBuilder()
    b.add(TensorSpec.create(name, shape, dtype), rank, box)
    return b.build()


@pytest.mark.parametrize(
    ("needed", "reason", "named"),
    [
        # A tensor no trainer holds.
        (
            ("model.extra.weight", (4,), "float32", ((0, 4),)),
            "INVALID_LAYOUT",
            "model.extra.weight",
        ),
        # Right name, wrong dtype.
        (("model.norm.weight", (8,), "bfloat16", ((0, 8),)), "INVALID_LAYOUT", "dtype"),
        # Right name, wrong shape.
        (("model.norm.weight", (9,), "float32", ((0, 9),)), "INVALID_LAYOUT", "shape"),
    ],
)
def test_unservable_layout_fails_before_any_command(
    coordinator, sim_cluster, needed, reason, named
):
    cluster = sim_cluster(coordinator)
    trainers = cluster.trainers(world=1)
    name, shape, dtype, box = needed
    gen = cluster.add(Role.GENERATOR, replica="a", layout=_layout(name, shape, dtype, 0, box))
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.state is RefitState.FAILED
    assert refit.reason == reason
    assert named in refit.message
    # Failed at PREPARING before anything went out: no group, no prepare; still serving.
    assert [t.phase for t in refit.timings][-1] is RefitState.PREPARING
    assert not trainers[0].agent.received(CreateRendezvousCmd)
    assert not gen.agent.received(JoinGroupCmd)
    assert not gen.agent.received(PrepareRefitCmd)
    assert client.topology("job").replicas[0].state is MemberState.READY


def test_uncovered_box_names_tensor_rank_and_box(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    # Two trainer ranks of world 2, but only rank 0 holds rows of model.norm.weight.
    cluster.add(Role.TRAINER, rank=0, world=2, layout=row_layout(0, 2))
    cluster.add(
        Role.TRAINER,
        rank=1,
        world=2,
        layout=_layout(
            "model.layers.0.mlp.down_proj.weight", (16, 8), "bfloat16", 1, ((8, 16), (0, 8))
        ),
    )
    cluster.replica("a")
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "UNCOVERED"
    assert "model.norm.weight" in refit.message
    assert "rank 2" in refit.message
    assert "[4:8]" in refit.message


def test_missing_members_and_mixed_devices(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, rank=0, world=2, layout=row_layout(0, 2))
    cluster.replica("a")
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "MEMBERS_MISSING"
    assert "trainer rank(s) 1 of 2" in refit.message

    cluster.add(Role.TRAINER, rank=1, world=2, layout=row_layout(1, 2), device="cuda:1")
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "INVALID_TOPOLOGY"
    assert "cpu and cuda" in refit.message


def test_trainer_without_layout(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    t = cluster.add(Role.TRAINER, rank=0, world=1)
    cluster.replica("a")
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "LAYOUT_MISSING"
    assert t.member_id in refit.message


def test_no_complete_replica(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.add(Role.GENERATOR, replica="a", rank=0, world=2, layout=row_layout(0, 2))
    client = cluster.client()
    refit = _wait(client, client.trigger("job").refit_id)
    assert refit.reason == "NO_TARGETS"
    assert "generator rank(s) 1 of 2" in refit.message
    refit = _wait(client, client.trigger("job", target_replicas=["a"]).refit_id)
    assert refit.reason == "MEMBERS_MISSING"
