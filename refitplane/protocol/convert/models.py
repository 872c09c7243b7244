"""The orchestrator-facing models (`refitplane.protocol.models`: Refit, Topology) ↔ `refit.v1`
common messages.

The coordinator uses the `*_to_proto` half, the client the `*_from_proto` half. Fields that a
model and its message hold under the same name and type are listed once per pair (`_REFIT`,
`_RANK`, ...) and copied both ways; each converter spells out only what changes on the way
(enums, repeated fields, nested messages). tests/unit/protocol/test_convert_parity.py fails
when a field is left out either way."""

from __future__ import annotations

from typing import Any

from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.protocol.convert import enums
from refitplane.protocol.models import Member, PhaseTiming, RankProgress, Refit, Replica, Topology

_REFIT = (
    "refit_id",
    "job",
    "version",
    "idempotency_key",
    "reason",
    "message",
    "created_unix",
    "updated_unix",
    "bytes_total",
    "bytes_done",
    "plan_digest",
    "group_epoch",
    "coalesced",
    "tensors_verified",
    "tensors_total",
    "bytes_on_wire",
    "start_sent_ns",
    "transfer_end_ns",
)
_RANK = (
    "member_id",
    "bytes_sent",
    "bytes_received",
    "bytes_total",
    "tensors_verified",
    "tensors_total",
    "start_seen_ns",
    "executor_start_ns",
    "executor_end_ns",
    "done_sent_ns",
    "done_recorded_ns",
)
_MEMBER = (
    "member_id",
    "job",
    "replica_id",
    "rank",
    "world_size",
    "host",
    "device",
    "group_rank",
    "layout_digest",
    "version",
    "lease_expires_unix",
    "node",
    "device_uuid",
)
_REPLICA = ("replica_id", "version", "world_size")
_TOPOLOGY = (
    "job",
    "group_epoch",
    "group_size",
    "committed_version",
    "source_layout_digest",
    "target_layout_digest",
    "healthy",
)


def _same(source: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields `names` of `source`, for a target that has them under the same name."""
    return {name: getattr(source, name) for name in names}


def refit_to_proto(refit: Refit) -> cpb.Refit:
    return cpb.Refit(
        **_same(refit, _REFIT),
        state=enums.refit_state_to_proto(refit.state),
        target_replicas=refit.target_replicas,
        timings=[
            cpb.PhaseTiming(phase=enums.refit_state_to_proto(t.phase), seconds=t.seconds)
            for t in refit.timings
        ],
        ranks=[cpb.RankProgress(**_same(r, _RANK)) for r in refit.ranks],
        delta_replicas=refit.delta_replicas,
    )


def refit_from_proto(msg: cpb.Refit) -> Refit:
    return Refit(
        **_same(msg, _REFIT),
        state=enums.refit_state_from_proto(msg.state),
        target_replicas=list(msg.target_replicas),
        timings=[
            PhaseTiming(
                phase=enums.refit_state_from_proto(t.phase, field="timings.phase"),
                seconds=t.seconds,
            )
            for t in msg.timings
        ],
        ranks=[RankProgress(**_same(r, _RANK)) for r in msg.ranks],
        delta_replicas=list(msg.delta_replicas),
    )


def _member_to_proto(member: Member) -> cpb.Member:
    return cpb.Member(
        **_same(member, _MEMBER),
        role=enums.role_to_proto(member.role),
        state=enums.member_state_to_proto(member.state),
        labels=member.labels,
    )


def _member_from_proto(msg: cpb.Member) -> Member:
    return Member(
        **_same(msg, _MEMBER),
        role=enums.role_from_proto(msg.role, field="members.role"),
        state=enums.member_state_from_proto(msg.state, field="members.state"),
        labels=dict(msg.labels),
    )


def topology_to_proto(topo: Topology) -> cpb.Topology:
    return cpb.Topology(
        **_same(topo, _TOPOLOGY),
        members=[_member_to_proto(x) for x in topo.members],
        replicas=[
            cpb.Replica(
                **_same(r, _REPLICA),
                state=enums.member_state_to_proto(r.state),
                member_ids=r.member_ids,
            )
            for r in topo.replicas
        ],
        backend=enums.backend_to_proto(topo.backend) if topo.backend else cpb.BACKEND_UNSPECIFIED,
    )


def topology_from_proto(msg: cpb.Topology) -> Topology:
    return Topology(
        **_same(msg, _TOPOLOGY),
        members=[_member_from_proto(x) for x in msg.members],
        replicas=[
            Replica(
                **_same(r, _REPLICA),
                state=enums.member_state_from_proto(r.state, field="replicas.state"),
                member_ids=list(r.member_ids),
            )
            for r in msg.replicas
        ],
        backend=enums.backend_from_proto(msg.backend) if msg.backend else None,
    )
