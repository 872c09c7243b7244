"""The orchestrator-facing models (`refitplane.protocol.models`: Refit, Topology) ↔ `refit.v1`
common messages.

The coordinator uses the `*_to_proto` half, the client the `*_from_proto` half."""

from __future__ import annotations

from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.protocol.convert import enums
from refitplane.protocol.models import Member, PhaseTiming, RankProgress, Refit, Replica, Topology


def refit_to_proto(refit: Refit) -> cpb.Refit:
    return cpb.Refit(
        refit_id=refit.refit_id,
        job=refit.job,
        version=refit.version,
        state=enums.refit_state_to_proto(refit.state),
        target_replicas=refit.target_replicas,
        idempotency_key=refit.idempotency_key,
        reason=refit.reason,
        message=refit.message,
        created_unix=refit.created_unix,
        updated_unix=refit.updated_unix,
        bytes_total=refit.bytes_total,
        bytes_done=refit.bytes_done,
        timings=[
            cpb.PhaseTiming(phase=enums.refit_state_to_proto(t.phase), seconds=t.seconds)
            for t in refit.timings
        ],
        ranks=[
            cpb.RankProgress(
                member_id=r.member_id,
                bytes_sent=r.bytes_sent,
                bytes_received=r.bytes_received,
                bytes_total=r.bytes_total,
                tensors_verified=r.tensors_verified,
                tensors_total=r.tensors_total,
            )
            for r in refit.ranks
        ],
        plan_digest=refit.plan_digest,
        group_epoch=refit.group_epoch,
        coalesced=refit.coalesced,
        tensors_verified=refit.tensors_verified,
        tensors_total=refit.tensors_total,
        bytes_on_wire=refit.bytes_on_wire,
        delta_replicas=refit.delta_replicas,
    )


def refit_from_proto(msg: cpb.Refit) -> Refit:
    return Refit(
        refit_id=msg.refit_id,
        job=msg.job,
        version=msg.version,
        state=enums.refit_state_from_proto(msg.state),
        target_replicas=list(msg.target_replicas),
        idempotency_key=msg.idempotency_key,
        reason=msg.reason,
        message=msg.message,
        created_unix=msg.created_unix,
        updated_unix=msg.updated_unix,
        bytes_total=msg.bytes_total,
        bytes_done=msg.bytes_done,
        timings=[
            PhaseTiming(
                phase=enums.refit_state_from_proto(t.phase, field="timings.phase"),
                seconds=t.seconds,
            )
            for t in msg.timings
        ],
        ranks=[
            RankProgress(
                member_id=r.member_id,
                bytes_sent=r.bytes_sent,
                bytes_received=r.bytes_received,
                bytes_total=r.bytes_total,
                tensors_verified=r.tensors_verified,
                tensors_total=r.tensors_total,
            )
            for r in msg.ranks
        ],
        plan_digest=msg.plan_digest,
        group_epoch=msg.group_epoch,
        coalesced=msg.coalesced,
        tensors_verified=msg.tensors_verified,
        tensors_total=msg.tensors_total,
        bytes_on_wire=msg.bytes_on_wire,
        delta_replicas=list(msg.delta_replicas),
    )


def _member_to_proto(member: Member) -> cpb.Member:
    return cpb.Member(
        member_id=member.member_id,
        job=member.job,
        role=enums.role_to_proto(member.role),
        replica_id=member.replica_id,
        rank=member.rank,
        world_size=member.world_size,
        host=member.host,
        device=member.device,
        state=enums.member_state_to_proto(member.state),
        group_rank=member.group_rank,
        layout_digest=member.layout_digest,
        version=member.version,
        lease_expires_unix=member.lease_expires_unix,
        labels=member.labels,
        node=member.node,
        device_uuid=member.device_uuid,
    )


def _member_from_proto(msg: cpb.Member) -> Member:
    return Member(
        member_id=msg.member_id,
        job=msg.job,
        role=enums.role_from_proto(msg.role, field="members.role"),
        replica_id=msg.replica_id,
        rank=msg.rank,
        world_size=msg.world_size,
        host=msg.host,
        device=msg.device,
        state=enums.member_state_from_proto(msg.state, field="members.state"),
        group_rank=msg.group_rank,
        layout_digest=msg.layout_digest,
        version=msg.version,
        lease_expires_unix=msg.lease_expires_unix,
        labels=dict(msg.labels),
        node=msg.node,
        device_uuid=msg.device_uuid,
    )


def topology_to_proto(topo: Topology) -> cpb.Topology:
    return cpb.Topology(
        job=topo.job,
        members=[_member_to_proto(x) for x in topo.members],
        replicas=[
            cpb.Replica(
                replica_id=r.replica_id,
                version=r.version,
                state=enums.member_state_to_proto(r.state),
                world_size=r.world_size,
                member_ids=r.member_ids,
            )
            for r in topo.replicas
        ],
        group_epoch=topo.group_epoch,
        group_size=topo.group_size,
        backend=enums.backend_to_proto(topo.backend) if topo.backend else cpb.BACKEND_UNSPECIFIED,
        committed_version=topo.committed_version,
        source_layout_digest=topo.source_layout_digest,
        target_layout_digest=topo.target_layout_digest,
        healthy=topo.healthy,
    )


def topology_from_proto(msg: cpb.Topology) -> Topology:
    return Topology(
        job=msg.job,
        members=[_member_from_proto(x) for x in msg.members],
        replicas=[
            Replica(
                replica_id=r.replica_id,
                version=r.version,
                state=enums.member_state_from_proto(r.state, field="replicas.state"),
                world_size=r.world_size,
                member_ids=list(r.member_ids),
            )
            for r in msg.replicas
        ],
        group_epoch=msg.group_epoch,
        group_size=msg.group_size,
        backend=enums.backend_from_proto(msg.backend) if msg.backend else None,
        committed_version=msg.committed_version,
        source_layout_digest=msg.source_layout_digest,
        target_layout_digest=msg.target_layout_digest,
        healthy=msg.healthy,
    )
