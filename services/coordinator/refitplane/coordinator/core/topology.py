"""A job's topology as the API shows it: a pure function of one snapshot of the job (its
members, its group epoch and replicas, who the refit in flight involves), so what a member
or replica reads as is decided in one place and can be tested without a coordinator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from refitplane.coordinator.core.failures import RefitFailed
from refitplane.coordinator.core.planning import Roster
from refitplane.coordinator.core.records import (
    GroupRecord,
    GroupState,
    MemberRecord,
    ReplicaRecord,
)
from refitplane.protocol import MemberState, Role
from refitplane.protocol.models import Member, Replica, Topology


@dataclass(frozen=True)
class DriverView:
    """What a job's driver knows that the store may not have yet."""

    group: GroupRecord
    replicas: Mapping[str, ReplicaRecord]
    # Participants of the refit in flight
    busy: frozenset[str] = frozenset()
    source_digest: str = ""
    target_digest: str = ""


@dataclass(frozen=True)
class JobSnapshot:
    job: str
    members: list[MemberRecord]
    committed_version: int
    driver: DriverView


def job_topology(snap: JobSnapshot) -> Topology:
    members = snap.members
    group = snap.driver.group
    busy = snap.driver.busy
    degraded = {r for r, rec in snap.driver.replicas.items() if rec.degraded}
    in_group = group.state in (GroupState.READY, GroupState.FORMING)

    def state_of(m: MemberRecord) -> MemberState:
        if not m.alive:
            return MemberState.LOST
        if m.role is not Role.TRAINER and m.replica_id in degraded:
            return MemberState.DEGRADED
        if m.member_id in busy:
            return MemberState.BUSY
        return m.state

    views = [
        Member(
            member_id=m.member_id,
            job=m.job,
            role=m.role,
            replica_id=m.replica_id,
            rank=m.rank,
            world_size=m.world_size,
            host=m.host,
            device=m.device,
            state=state_of(m),
            group_rank=group.rank_of(m.member_id) if in_group else -1,
            layout_digest=m.layout_digest,
            version=m.version,
            lease_expires_unix=m.lease_expires_unix,
            labels=dict(m.labels),
            node=m.node,
            device_uuid=m.device_uuid,
        )
        for m in sorted(members, key=lambda m: (m.role.value, m.replica_id, m.rank))
    ]
    roster = Roster.of(members)
    replica_views = []
    for rid in sorted({m.replica_id for m in members if m.role is not Role.TRAINER}):
        rep = roster.replicas.get(rid)
        all_of = [m for m in members if m.replica_id == rid and m.role is not Role.TRAINER]
        ranks = [m for m in all_of if m.role is Role.GENERATOR]
        # What its live ranks hold; while every rank is LOST (a lease that lapsed under
        # load, before the agent registers again), what they held last, not 0.
        data = [m for m in ranks if m.alive] or ranks
        version = min((m.version for m in data), default=0)
        if rid in degraded:
            state = MemberState.DEGRADED
        elif rep is None or rep.problem() is not None or any(not m.alive for m in all_of):
            state = MemberState.LOST if any(not m.alive for m in all_of) else MemberState.JOINING
        elif any(m.member_id in busy for m in all_of):
            state = MemberState.BUSY
        else:
            state = MemberState.READY
        replica_views.append(
            Replica(
                replica_id=rid,
                version=version,
                state=state,
                world_size=rep.world_size if rep is not None else 0,
                member_ids=[m.member_id for m in all_of],
            )
        )
    trainers_ok = True
    try:
        roster.check_trainers()
    except RefitFailed:
        trainers_ok = False
    healthy = (
        trainers_ok
        and any(r.state in (MemberState.READY, MemberState.BUSY) for r in replica_views)
        and all(v.state is not MemberState.LOST for v in views)
        and not degraded
        and group.state is not GroupState.POISONED
    )
    return Topology(
        job=snap.job,
        members=views,
        replicas=replica_views,
        group_epoch=group.epoch,
        group_size=group.size if in_group else 0,
        backend=group.backend,
        committed_version=snap.committed_version,
        source_layout_digest=snap.driver.source_digest,
        target_layout_digest=snap.driver.target_digest,
        healthy=healthy,
    )
