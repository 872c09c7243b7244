"""The agent protocol's messages (`refitplane.protocol.messages`: registration, commands,
reports) ↔ `refit.v1` agent messages.

The agent session and the coordinator both call these, so the two ends of the wire cannot
drift apart. Conversions from protobuf validate; errors name the field path at fault.
"""

from __future__ import annotations

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.errors import InvalidArgument
from refitplane.protocol import messages as m
from refitplane.protocol.convert.enums import (
    backend_from_proto,
    backend_to_proto,
    role_from_proto,
    role_to_proto,
)
from refitplane.protocol.convert.reshard import (
    config_from_proto,
    config_to_proto,
    rank_plan_from_proto,
    rank_plan_to_proto,
)
from refitplane.reasons import Reason

# --- registration ---------------------------------------------------------------------------


def register_to_proto(info: m.MemberInfo) -> apb.RegisterRequest:
    return apb.RegisterRequest(
        job=info.job,
        role=role_to_proto(info.role),
        replica_id=info.replica_id,
        rank=info.rank,
        world_size=info.world_size,
        host=info.host,
        device=info.device,
        labels=dict(info.labels),
        version=info.version,
        delta_receive=info.delta_receive,
        node=info.node,
        device_uuid=info.device_uuid,
    )


def register_from_proto(msg: apb.RegisterRequest) -> m.MemberInfo:
    """Field-level conversion only; the coordinator validates values (names, ranges)."""
    return m.MemberInfo(
        job=msg.job,
        role=role_from_proto(msg.role),
        replica_id=msg.replica_id,
        rank=msg.rank,
        world_size=msg.world_size,
        host=msg.host,
        device=msg.device,
        labels=dict(msg.labels),
        version=msg.version,
        delta_receive=msg.delta_receive,
        node=msg.node,
        device_uuid=msg.device_uuid,
    )


# --- commands -------------------------------------------------------------------------------


def command_to_proto(cmd: m.Command) -> apb.Command:
    body = cmd.body
    out = apb.Command(seq=cmd.seq)
    match body:
        case m.CreateRendezvousCmd():
            out.create_rendezvous.CopyFrom(
                apb.CreateRendezvous(
                    epoch=body.epoch,
                    backend=backend_to_proto(body.backend),
                    group_size=body.group_size,
                    num_channels=body.num_channels,
                )
            )
        case m.JoinGroupCmd():
            out.join_group.CopyFrom(
                apb.JoinGroup(
                    epoch=body.epoch,
                    backend=backend_to_proto(body.backend),
                    group_rank=body.group_rank,
                    group_size=body.group_size,
                    num_channels=body.num_channels,
                    rendezvous=body.rendezvous,
                    timeout_s=body.timeout_s,
                )
            )
        case m.LeaveGroupCmd():
            out.leave_group.CopyFrom(apb.LeaveGroup(epoch=body.epoch, abort=body.abort))
        case m.PrepareRefitCmd():
            prepare = apb.PrepareRefit(
                refit_id=body.refit_id,
                version=body.version,
                epoch=body.epoch,
                pause_mode=body.pause_mode,
                plan_digest=body.plan_digest,
                plan_rank=body.plan_rank,
                delta_peers=sorted(body.delta_peers),
                delta_base_version=body.delta_base_version,
            )
            if body.plan is not None:
                prepare.plan.CopyFrom(rank_plan_to_proto(body.plan))
            if body.config is not None:
                prepare.config.CopyFrom(config_to_proto(body.config))
            out.prepare_refit.CopyFrom(prepare)
        case m.StartTransferCmd():
            out.start_transfer.CopyFrom(
                apb.StartTransfer(
                    refit_id=body.refit_id,
                    version=body.version,
                    ranks_verified=body.ranks_verified,
                )
            )
        case m.AbortRefitCmd():
            out.abort_refit.CopyFrom(
                apb.AbortRefit(refit_id=body.refit_id, reason=body.reason, message=body.message)
            )
        case m.RanksVerifiedCmd():
            out.ranks_verified.CopyFrom(
                apb.RanksVerified(
                    refit_id=body.refit_id,
                    version=body.version,
                    member_ids=sorted(body.member_ids),
                )
            )
    return out


def command_from_proto(msg: apb.Command) -> m.Command:
    kind = msg.WhichOneof("command")
    body: m.CommandBody
    if kind == "create_rendezvous":
        c = msg.create_rendezvous
        body = m.CreateRendezvousCmd(
            epoch=c.epoch,
            backend=backend_from_proto(c.backend, field="create_rendezvous.backend"),
            group_size=c.group_size,
            num_channels=c.num_channels,
        )
    elif kind == "join_group":
        j = msg.join_group
        body = m.JoinGroupCmd(
            epoch=j.epoch,
            backend=backend_from_proto(j.backend, field="join_group.backend"),
            group_rank=j.group_rank,
            group_size=j.group_size,
            num_channels=j.num_channels,
            rendezvous=j.rendezvous,
            timeout_s=j.timeout_s,
        )
    elif kind == "leave_group":
        body = m.LeaveGroupCmd(epoch=msg.leave_group.epoch, abort=msg.leave_group.abort)
    elif kind == "prepare_refit":
        p = msg.prepare_refit
        plan = (
            rank_plan_from_proto(p.plan, field="prepare_refit.plan") if p.HasField("plan") else None
        )
        # A coordinator that predates plan references sends only the body: it names itself.
        digest, rank = p.plan_digest, p.plan_rank
        if plan is not None and not digest:
            digest, rank = plan.plan_digest, plan.rank
        body = m.PrepareRefitCmd(
            refit_id=p.refit_id,
            version=p.version,
            epoch=p.epoch,
            plan=plan,
            config=config_from_proto(p.config) if p.HasField("config") else None,
            pause_mode=p.pause_mode,
            plan_digest=digest,
            plan_rank=rank,
            delta_peers=frozenset(p.delta_peers),
            delta_base_version=p.delta_base_version,
        )
    elif kind == "start_transfer":
        t = msg.start_transfer
        body = m.StartTransferCmd(
            refit_id=t.refit_id, version=t.version, ranks_verified=t.ranks_verified
        )
    elif kind == "abort_refit":
        a = msg.abort_refit
        body = m.AbortRefitCmd(refit_id=a.refit_id, reason=a.reason, message=a.message)
    elif kind == "ranks_verified":
        v = msg.ranks_verified
        body = m.RanksVerifiedCmd(
            refit_id=v.refit_id, version=v.version, member_ids=frozenset(v.member_ids)
        )
    else:
        raise InvalidArgument("command has no body", field="command")
    return m.Command(seq=msg.seq, body=body)


# --- reports --------------------------------------------------------------------------------


def report_to_proto(report: m.Report) -> apb.ReportRequest:
    out = apb.ReportRequest(member_id=report.member_id, refit_id=report.refit_id)
    body = report.body
    match body:
        case m.RendezvousReady():
            out.rendezvous_ready.CopyFrom(
                apb.RendezvousReady(epoch=body.epoch, rendezvous=body.rendezvous)
            )
        case m.GroupJoined():
            out.group_joined.CopyFrom(apb.GroupJoined(epoch=body.epoch))
        case m.Prepared():
            out.prepared.SetInParent()
        case m.Progress():
            out.progress.CopyFrom(
                apb.Progress(
                    bytes_sent=body.bytes_sent,
                    bytes_received=body.bytes_received,
                    bytes_total=body.bytes_total,
                )
            )
        case m.TransferDone():
            out.transfer_done.CopyFrom(
                apb.TransferDone(
                    bytes_sent=body.bytes_sent,
                    bytes_received=body.bytes_received,
                    seconds=body.seconds,
                    tensors_verified=body.tensors_verified,
                    tensors_total=body.tensors_total,
                    bytes_full=body.bytes_full,
                    delta_base_version=body.delta_base_version,
                    start_seen_ns=body.hops.start_seen_ns,
                    executor_start_ns=body.hops.executor_start_ns,
                    executor_end_ns=body.hops.executor_end_ns,
                    sent_ns=body.hops.sent_ns,
                )
            )
        case m.ReplicaUpdated():
            out.replica_updated.CopyFrom(apb.ReplicaUpdated(version=body.version))
        case m.PlanMissing():
            out.plan_missing.CopyFrom(
                apb.PlanMissing(
                    plan_digest=body.plan_digest, plan_rank=body.plan_rank, message=body.message
                )
            )
        case m.Failure():
            out.failure.CopyFrom(
                apb.Failure(
                    reason=body.reason,
                    message=body.message,
                    weights_modified=body.weights_modified,
                    epoch=body.epoch,
                )
            )
    return out


def report_from_proto(msg: apb.ReportRequest) -> m.Report:
    kind = msg.WhichOneof("report")
    body: m.ReportBody
    if kind == "rendezvous_ready":
        body = m.RendezvousReady(
            epoch=msg.rendezvous_ready.epoch, rendezvous=msg.rendezvous_ready.rendezvous
        )
    elif kind == "group_joined":
        body = m.GroupJoined(epoch=msg.group_joined.epoch)
    elif kind == "prepared":
        body = m.Prepared()
    elif kind == "progress":
        p = msg.progress
        body = m.Progress(
            bytes_sent=p.bytes_sent, bytes_received=p.bytes_received, bytes_total=p.bytes_total
        )
    elif kind == "transfer_done":
        d = msg.transfer_done
        if d.seconds < 0 or d.seconds != d.seconds:
            raise InvalidArgument(
                "transfer_done.seconds must be a non-negative number", field="transfer_done.seconds"
            )
        if d.tensors_verified > d.tensors_total:
            raise InvalidArgument(
                f"transfer_done.tensors_verified ({d.tensors_verified}) exceeds tensors_total "
                f"({d.tensors_total})",
                field="transfer_done.tensors_verified",
            )
        body = m.TransferDone(
            bytes_sent=d.bytes_sent,
            bytes_received=d.bytes_received,
            seconds=d.seconds,
            tensors_verified=d.tensors_verified,
            tensors_total=d.tensors_total,
            bytes_full=d.bytes_full,
            delta_base_version=d.delta_base_version,
            hops=m.HopStamps(
                start_seen_ns=d.start_seen_ns,
                executor_start_ns=d.executor_start_ns,
                executor_end_ns=d.executor_end_ns,
                sent_ns=d.sent_ns,
            ),
        )
    elif kind == "replica_updated":
        body = m.ReplicaUpdated(version=msg.replica_updated.version)
    elif kind == "plan_missing":
        missing = msg.plan_missing
        if not missing.plan_digest:
            raise InvalidArgument(
                "plan_missing.plan_digest names no plan", field="plan_missing.plan_digest"
            )
        body = m.PlanMissing(
            plan_digest=missing.plan_digest,
            plan_rank=missing.plan_rank,
            message=missing.message,
        )
    elif kind == "failure":
        f = msg.failure
        body = m.Failure(
            reason=f.reason or Reason.UNKNOWN,
            message=f.message,
            weights_modified=f.weights_modified,
            epoch=f.epoch,
        )
    else:
        raise InvalidArgument("report has no body (set one of its oneof fields)", field="report")
    return m.Report(member_id=msg.member_id, refit_id=msg.refit_id, body=body)
