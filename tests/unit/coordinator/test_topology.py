"""A job's topology is a pure function of a snapshot: member and replica states, group ranks
and health follow from the members, the group epoch, the replicas and the refit in flight."""

from __future__ import annotations

import pytest

from refitplane.coordinator.core.records import GroupRecord, GroupState, MemberRecord, ReplicaRecord
from refitplane.coordinator.core.topology import DriverView, JobSnapshot, job_topology
from refitplane.protocol import Backend, MemberState, Role

pytestmark = pytest.mark.unit


def _m(mid, role, rank=0, world=1, replica="", state=MemberState.READY, version=0):
    return MemberRecord(
        member_id=mid,
        job="j",
        role=role,
        rank=rank,
        world_size=world,
        replica_id=replica,
        layout_digest="d",
        state=state,
        version=version,
    )


MEMBERS = [
    _m("t0", Role.TRAINER, 0, 2),
    _m("t1", Role.TRAINER, 1, 2),
    _m("a0", Role.GENERATOR, 0, 1, "a", version=3),
    _m("b0", Role.GENERATOR, 0, 1, "b", version=2),
]
READY = GroupRecord(
    job="j",
    epoch=4,
    state=GroupState.READY,
    backend=Backend.GLOO,
    members=["t0", "t1", "a0", "b0"],
    num_channels=1,
)


def _topology(members=MEMBERS, **driver):
    view = DriverView(**{"group": READY, "replicas": {}, **driver})
    return job_topology(JobSnapshot("j", members, 3, view))


def test_a_steady_job_is_healthy_with_group_ranks_and_versions():
    topo = _topology(source_digest="s", target_digest="t")
    assert topo.healthy
    assert (topo.group_epoch, topo.group_size, topo.committed_version) == (4, 4, 3)
    assert (topo.source_layout_digest, topo.target_layout_digest) == ("s", "t")
    ranks = {m.member_id: m.group_rank for m in topo.members}
    assert ranks == {"t0": 0, "t1": 1, "a0": 2, "b0": 3}
    assert [(r.replica_id, r.version, r.state) for r in topo.replicas] == [
        ("a", 3, MemberState.READY),
        ("b", 2, MemberState.READY),
    ]


def test_refit_participants_read_busy_and_degraded_replicas_degraded():
    topo = _topology(
        busy=frozenset({"t0", "t1", "a0"}),
        replicas={"b": ReplicaRecord(replica_id="b", degraded=True)},
    )
    states = {m.member_id: m.state for m in topo.members}
    assert states == {
        "t0": MemberState.BUSY,
        "t1": MemberState.BUSY,
        "a0": MemberState.BUSY,
        "b0": MemberState.DEGRADED,
    }
    assert {r.replica_id: r.state for r in topo.replicas} == {
        "a": MemberState.BUSY,
        "b": MemberState.DEGRADED,
    }
    assert not topo.healthy


def test_a_poisoned_group_has_no_ranks_and_is_unhealthy():
    poisoned = READY.model_copy(update={"state": GroupState.POISONED})
    topo = _topology(group=poisoned)
    assert topo.group_size == 0
    assert all(m.group_rank == -1 for m in topo.members)
    assert not topo.healthy


def test_a_lost_member_makes_its_replica_lost_and_the_job_unhealthy():
    members = [
        *MEMBERS[:2],
        _m("a0", Role.GENERATOR, 0, 1, "a", state=MemberState.LOST),
        MEMBERS[3],
    ]
    topo = _topology(members)
    assert {r.replica_id: r.state for r in topo.replicas} == {
        "a": MemberState.LOST,
        "b": MemberState.READY,
    }
    assert not topo.healthy


def test_a_missing_trainer_rank_makes_the_job_unhealthy():
    assert not _topology([m for m in MEMBERS if m.member_id != "t1"]).healthy
