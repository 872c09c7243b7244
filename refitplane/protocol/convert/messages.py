"""Protobuf ↔ domain conversion for `refit.v1` (common + agent messages), in one place.

The agent session and the coordinator both import this module, so the two ends of the wire
cannot drift apart. Conversions *from* protobuf validate: anything malformed raises
`InvalidArgument`/`LayoutError` whose `field` is the path of the bad field in the request
(e.g. `layout.tensors[3].boxes[0]`), and whose message names the tensor, rank and box.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.agent import messages as m
from refitplane.errors import InvalidArgument, LayoutError
from refitplane.protocol import Backend, MemberState, RefitState, Role
from refitplane.reshard.boxes import Box
from refitplane.reshard.config import DELTA_MAX_CHANGED, DIRECT_MIN_BYTES, TransferConfig
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan

# A layout with more tensors than this is refused before any work is done on it (the largest
# MoE checkpoints have ~10^5 tensors).
MAX_LAYOUT_TENSORS = 1_000_000

_ROLE_NAMES = {v.number: v.name for v in cpb.Role.DESCRIPTOR.values}
_BACKEND_NAMES = {v.number: v.name for v in cpb.Backend.DESCRIPTOR.values}
_MEMBER_STATE_NAMES = {v.number: v.name for v in cpb.MemberState.DESCRIPTOR.values}
_REFIT_STATE_NAMES = {v.number: v.name for v in cpb.RefitState.DESCRIPTOR.values}

# --- enums ------------------------------------------------------------------------------


def role_from_proto(number: int, *, field: str = "role") -> Role:
    return Role.from_proto(number, _ROLE_NAMES, field=field)


def role_to_proto(role: Role) -> cpb.Role.ValueType:
    return cpb.Role.Value(role.proto_name())


def backend_from_proto(number: int, *, field: str = "backend") -> Backend:
    return Backend.from_proto(number, _BACKEND_NAMES, field=field)


def backend_to_proto(backend: Backend) -> cpb.Backend.ValueType:
    return cpb.Backend.Value(backend.proto_name())


def member_state_from_proto(number: int, *, field: str = "state") -> MemberState:
    return MemberState.from_proto(number, _MEMBER_STATE_NAMES, field=field)


def member_state_to_proto(state: MemberState) -> cpb.MemberState.ValueType:
    return cpb.MemberState.Value(state.proto_name())


def refit_state_from_proto(number: int, *, field: str = "state") -> RefitState:
    return RefitState.from_proto(number, _REFIT_STATE_NAMES, field=field)


def refit_state_to_proto(state: RefitState) -> cpb.RefitState.ValueType:
    return cpb.RefitState.Value(state.proto_name())


# --- boxes, layouts ---------------------------------------------------------------------

_L = TypeVar("_L", bound=LayoutError)


def _at(exc: _L, path: str) -> _L:
    """The same error, with `field` set to the request path of the offending value."""
    new = type(exc)(exc.message, field=path)
    new.tensor, new.rank, new.box = exc.tensor, exc.rank, exc.box
    return new


def box_to_proto(box: Box) -> cpb.Box:
    return cpb.Box(start=[a for a, _ in box], stop=[b for _, b in box])


def box_from_proto(msg: cpb.Box, *, field: str, tensor: str | None = None) -> Box:
    if len(msg.start) != len(msg.stop):
        raise LayoutError(
            f"box has {len(msg.start)} start values but {len(msg.stop)} stop values",
            tensor=tensor,
            field=field,
        )
    return tuple(zip(msg.start, msg.stop, strict=True))


def spec_to_proto(spec: TensorSpec) -> cpb.TensorSpec:
    return cpb.TensorSpec(name=spec.name, shape=spec.shape, dtype=spec.dtype)


def spec_from_proto(msg: cpb.TensorSpec, *, field: str) -> TensorSpec:
    try:
        return TensorSpec.create(msg.name, list(msg.shape), msg.dtype)
    except LayoutError as exc:
        raise _at(exc, f"{field}.{exc.field or 'name'}") from None


def layout_to_proto(layout: Layout, rank: int) -> cpb.RankLayout:
    """The part of `layout` that `rank` holds or needs, as a RankLayout (which has no rank:
    the coordinator knows it from the member)."""
    out = cpb.RankLayout()
    for t in layout:
        boxes = t.boxes.get(rank)
        if boxes:
            out.tensors.append(
                cpb.TensorBoxes(spec=spec_to_proto(t.spec), boxes=[box_to_proto(b) for b in boxes])
            )
    return out


def layout_from_proto(msg: cpb.RankLayout, rank: int, *, field: str = "layout") -> Layout:
    """Validate and convert what one rank published; every error names the request path."""
    if len(msg.tensors) > MAX_LAYOUT_TENSORS:
        raise LayoutError(
            f"{len(msg.tensors)} tensors (at most {MAX_LAYOUT_TENSORS})", field=f"{field}.tensors"
        )
    builder = LayoutBuilder()
    for i, entry in enumerate(msg.tensors):
        path = f"{field}.tensors[{i}]"
        if not entry.HasField("spec"):
            raise LayoutError("spec is missing", field=f"{path}.spec")
        spec = spec_from_proto(entry.spec, field=f"{path}.spec")
        if not entry.boxes:
            raise LayoutError("lists no boxes", tensor=spec.name, rank=rank, field=f"{path}.boxes")
        try:
            builder.add_spec(spec)
        except LayoutError as exc:
            raise _at(exc, f"{path}.spec.{exc.field or 'name'}") from None
        for j, box_msg in enumerate(entry.boxes):
            box_path = f"{path}.boxes[{j}]"
            box = box_from_proto(box_msg, field=box_path, tensor=spec.name)
            try:
                builder.add(spec, rank, box)
            except LayoutError as exc:
                raise _at(exc, box_path) from None
    return builder.build()


# --- plans, transfer config -----------------------------------------------------------------


def _links_to_proto(links: tuple[Link, ...], index: Mapping[str, int]) -> list[cpb.Link]:
    return [
        cpb.Link(
            src=link.src,
            dst=link.dst,
            nbytes=link.nbytes,
            pieces=[
                cpb.Piece(tensor=index[p.tensor], box=box_to_proto(p.box)) for p in link.pieces
            ],
        )
        for link in links
    ]


def rank_plan_to_proto(plan: RankPlan) -> cpb.RankPlan:
    names = sorted(plan.specs)
    index = {n: i for i, n in enumerate(names)}
    return cpb.RankPlan(
        rank=plan.rank,
        plan_digest=plan.plan_digest,
        specs=[spec_to_proto(plan.specs[n]) for n in names],
        sends=_links_to_proto(plan.sends, index),
        recvs=_links_to_proto(plan.recvs, index),
    )


def _links_from_proto(links: list[cpb.Link], names: list[str], field: str) -> tuple[Link, ...]:
    out = []
    for i, link in enumerate(links):
        pieces = []
        for j, piece in enumerate(link.pieces):
            path = f"{field}[{i}].pieces[{j}]"
            if piece.tensor >= len(names):
                raise InvalidArgument(
                    f"{path}.tensor: index {piece.tensor} but the plan has {len(names)} specs",
                    field=f"{path}.tensor",
                )
            name = names[piece.tensor]
            pieces.append(Piece(name, box_from_proto(piece.box, field=f"{path}.box", tensor=name)))
        out.append(Link(src=link.src, dst=link.dst, pieces=tuple(pieces), nbytes=link.nbytes))
    return tuple(out)


def rank_plan_from_proto(msg: cpb.RankPlan, *, field: str = "plan") -> RankPlan:
    specs = [spec_from_proto(s, field=f"{field}.specs[{i}]") for i, s in enumerate(msg.specs)]
    names = [s.name for s in specs]
    return RankPlan(
        rank=msg.rank,
        specs={s.name: s for s in specs},
        sends=_links_from_proto(list(msg.sends), names, f"{field}.sends"),
        recvs=_links_from_proto(list(msg.recvs), names, f"{field}.recvs"),
        plan_digest=msg.plan_digest,
    )


def config_to_proto(config: TransferConfig) -> cpb.TransferConfig:
    return cpb.TransferConfig(
        bucket_bytes=config.bucket_bytes,
        num_channels=config.num_channels,
        max_inflight_bytes=config.max_inflight_bytes,
        timeout_s=config.timeout_s,
        verify_checksums=config.verify_checksums,
        direct_min_bytes=config.direct_min_bytes,
        delta=config.delta,
        delta_max_changed=config.delta_max_changed,
    )


def config_from_proto(msg: cpb.TransferConfig) -> TransferConfig:
    return TransferConfig(
        bucket_bytes=msg.bucket_bytes,
        num_channels=msg.num_channels,
        max_inflight_bytes=msg.max_inflight_bytes,
        timeout_s=msg.timeout_s,
        verify_checksums=msg.verify_checksums,
        # 0: a coordinator that predates the field; use the default.
        direct_min_bytes=msg.direct_min_bytes or DIRECT_MIN_BYTES,
        delta=msg.delta or "off",
        delta_max_changed=msg.delta_max_changed if msg.delta else DELTA_MAX_CHANGED,
    )


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
                apb.StartTransfer(refit_id=body.refit_id, version=body.version)
            )
        case m.AbortRefitCmd():
            out.abort_refit.CopyFrom(
                apb.AbortRefit(refit_id=body.refit_id, reason=body.reason, message=body.message)
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
        body = m.StartTransferCmd(
            refit_id=msg.start_transfer.refit_id, version=msg.start_transfer.version
        )
    elif kind == "abort_refit":
        a = msg.abort_refit
        body = m.AbortRefitCmd(refit_id=a.refit_id, reason=a.reason, message=a.message)
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
            reason=f.reason or "UNKNOWN",
            message=f.message,
            weights_modified=f.weights_modified,
            epoch=f.epoch,
        )
    else:
        raise InvalidArgument("report has no body (set one of its oneof fields)", field="report")
    return m.Report(member_id=msg.member_id, refit_id=msg.refit_id, body=body)
