"""Parity of every proto ⇄ model converter pair in `refitplane.protocol.convert`: a new field
on either side cannot be forgotten silently.

For each pair a sample model sets every one of its fields to a non-default value (checked
here against the model's own field list), `*_to_proto` must then set every field of the
proto message (walked through its descriptor, nested messages and the chosen oneof member
included) unless `DROPPED` names it with the reason, and `*_from_proto` must give the
sample back. A proto field added without a converter change fails the first check; a model
field added without one fails the sample check, then the round trip."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from pydantic import BaseModel

from refitplane.protocol import Backend, MemberState, RefitState, Role, convert
from refitplane.protocol import messages as m
from refitplane.protocol.convert import enums
from refitplane.protocol.models import Member, PhaseTiming, RankProgress, Refit, Replica, Topology
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan

pytestmark = pytest.mark.unit

# Proto fields (message full name . field) no converter maps, and why. Empty today.
DROPPED: dict[str, str] = {}
# Model fields a sample leaves at their default, and why.
AT_DEFAULT = {
    # True is the model's default but false the proto's: a sample with true shows the
    # mapping in the proto check; test_transfer_config round-trips false as well.
    "TransferConfig.verify_checksums": "proto default is false",
}

SPEC_W = TensorSpec.create("model.w", (8, 4), "bfloat16")
SPEC_B = TensorSpec.create("model.b", (8,), "float32")
PLAN = RankPlan(
    rank=2,
    specs={SPEC_W.name: SPEC_W, SPEC_B.name: SPEC_B},
    sends=(Link(src=2, dst=3, pieces=(Piece(SPEC_W.name, ((0, 4), (0, 4))),), nbytes=32),),
    # Piece.tensor indexes the sorted specs: model.w is 1 (0 would read as unset).
    recvs=(Link(src=1, dst=2, pieces=(Piece(SPEC_W.name, ((4, 8), (0, 4))),), nbytes=32),),
    plan_digest="d" * 64,
)
CONFIG = TransferConfig(
    bucket_bytes=4096,
    num_channels=3,
    max_inflight_bytes=8192,
    timeout_s=9.5,
    verify_checksums=True,
    direct_min_bytes=2048,
    delta="auto",
    delta_max_changed=0.25,
)
MEMBER_INFO = m.MemberInfo(
    job="job",
    role=Role.GENERATOR,
    rank=1,
    world_size=2,
    replica_id="rep-0",
    host="10.0.0.2",
    device="cuda:1",
    labels={"receive_mode": "staged"},
    version=7,
    delta_receive=True,
    node="node-a",
    device_uuid="GPU-0f1e2d3c",
)
COMMANDS: list[m.CommandBody] = [
    m.CreateRendezvousCmd(epoch=3, backend=Backend.NCCL, group_size=4, num_channels=2),
    m.JoinGroupCmd(
        epoch=3,
        backend=Backend.GLOO,
        group_rank=1,
        group_size=4,
        num_channels=2,
        rendezvous=b"id",
        timeout_s=30.0,
    ),
    m.LeaveGroupCmd(epoch=3, abort=True),
    m.PrepareRefitCmd(
        refit_id="r1",
        version=7,
        epoch=3,
        plan=PLAN,
        config=CONFIG,
        pause_mode="wait",
        plan_digest=PLAN.plan_digest,
        plan_rank=PLAN.rank,
        delta_peers=frozenset({0, 1}),
        delta_base_version=6,
    ),
    m.StartTransferCmd(refit_id="r1", version=7, ranks_verified=True),
    m.AbortRefitCmd(refit_id="r1", reason="TIMEOUT", message="too slow"),
    m.RanksVerifiedCmd(refit_id="r1", version=7, member_ids=frozenset({"g0", "g1"})),
]
REPORTS: list[m.ReportBody] = [
    m.RendezvousReady(epoch=3, rendezvous=b"id"),
    m.GroupJoined(epoch=3),
    m.Prepared(),
    m.Progress(bytes_sent=1, bytes_received=2, bytes_total=3),
    m.TransferDone(
        bytes_sent=1,
        bytes_received=2,
        seconds=0.5,
        tensors_verified=3,
        tensors_total=4,
        bytes_full=5,
        delta_base_version=6,
        hops=m.HopStamps(start_seen_ns=11, executor_start_ns=12, executor_end_ns=13, sent_ns=14),
    ),
    m.ReplicaUpdated(version=7),
    m.PlanMissing(plan_digest="d" * 64, plan_rank=2, message="evicted"),
    m.Failure(reason="PEER_FAILED", message="gone", weights_modified=True, epoch=3),
]
REFIT = Refit(
    refit_id="r1",
    job="job",
    version=7,
    state=RefitState.FAILED,
    target_replicas=["rep-0"],
    idempotency_key="k",
    reason="TIMEOUT",
    message="too slow",
    created_unix=1.5,
    updated_unix=2.5,
    bytes_total=100,
    bytes_done=50,
    timings=[PhaseTiming(phase=RefitState.TRANSFERRING, seconds=0.25)],
    ranks=[
        RankProgress(
            member_id="m1",
            bytes_sent=1,
            bytes_received=2,
            bytes_total=3,
            tensors_verified=4,
            tensors_total=5,
            start_seen_ns=11,
            executor_start_ns=12,
            executor_end_ns=13,
            done_sent_ns=14,
            done_recorded_ns=15,
        )
    ],
    plan_digest="d" * 64,
    group_epoch=3,
    coalesced=2,
    tensors_verified=4,
    tensors_total=5,
    bytes_on_wire=40,
    delta_replicas=["rep-0"],
    start_sent_ns=10,
    transfer_end_ns=16,
)
TOPOLOGY = Topology(
    job="job",
    members=[
        Member(
            member_id="m1",
            job="job",
            role=Role.GENERATOR,
            replica_id="rep-0",
            rank=1,
            world_size=2,
            host="10.0.0.2",
            device="cuda:1",
            state=MemberState.BUSY,
            group_rank=3,
            layout_digest="l" * 64,
            version=7,
            lease_expires_unix=9.5,
            labels={"receive_mode": "staged"},
            node="node-a",
            device_uuid="GPU-0f1e2d3c",
        )
    ],
    replicas=[
        Replica(
            replica_id="rep-0",
            version=7,
            state=MemberState.READY,
            world_size=2,
            member_ids=["m1", "m2"],
        )
    ],
    group_epoch=3,
    group_size=4,
    backend=Backend.NCCL,
    committed_version=6,
    source_layout_digest="s" * 64,
    target_layout_digest="t" * 64,
    healthy=True,
)


# --- the checks -----------------------------------------------------------------------------


def _unset(msg: Message, path: str = "") -> Iterator[str]:
    """Every field of `msg` (recursively) left at its default, as `Message.field` names."""
    for f in msg.DESCRIPTOR.fields:
        key = f"{msg.DESCRIPTOR.full_name}.{f.name}"
        where = f"{path}{f.name}"
        oneof = f.containing_oneof
        if oneof is not None and msg.WhichOneof(oneof.name) != f.name:
            continue  # another member of the oneof is the one chosen
        value = getattr(msg, f.name)
        if key in DROPPED:
            continue
        if f.is_repeated:
            if not len(value):
                yield key
            elif f.type == FieldDescriptor.TYPE_MESSAGE and not (
                f.message_type.GetOptions().map_entry
            ):
                yield from _unset(value[0], f"{where}[0].")
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            if not msg.HasField(f.name):
                yield key
            else:
                yield from _unset(value, f"{where}.")
        elif value == f.default_value:
            yield key


def _default_of(f: Any) -> Any:
    if isinstance(f, dataclasses.Field):
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return dataclasses.MISSING
    if f.is_required():
        return dataclasses.MISSING
    return f.get_default(call_default_factory=True)


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, BaseModel):
        return dict(type(obj).model_fields)
    return {f.name: f for f in dataclasses.fields(obj)}


def _defaulted(obj: Any, path: str = "") -> Iterator[str]:
    """Fields of a sample (recursively) still at their defaults: the sample must set all."""
    for name, f in _fields(obj).items():
        value = getattr(obj, name)
        default = _default_of(f)
        known = f"{type(obj).__name__}.{name}" in AT_DEFAULT
        if default is not dataclasses.MISSING and value == default and not known:
            yield f"{path}{type(obj).__name__}.{name}"
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, BaseModel) or (
                dataclasses.is_dataclass(item) and not isinstance(item, type)
            ):
                yield from _defaulted(item, f"{path}{type(obj).__name__}.{name}/")


def _check(sample: Any, to_proto: Callable[[Any], Message], from_proto: Callable[..., Any]) -> None:
    assert not list(_defaulted(sample)), "the sample leaves fields at their defaults"
    msg = to_proto(sample)
    assert not list(_unset(msg)), f"{type(msg).__name__}: proto fields the converter never sets"
    assert from_proto(msg) == sample


# --- one test per converter pair ------------------------------------------------------------


def test_registration() -> None:
    _check(MEMBER_INFO, convert.register_to_proto, convert.register_from_proto)


@pytest.mark.parametrize("body", COMMANDS, ids=lambda b: type(b).__name__)
def test_commands(body: m.CommandBody) -> None:
    _check(m.Command(seq=5, body=body), convert.command_to_proto, convert.command_from_proto)


def test_every_command_kind_has_a_sample() -> None:
    oneof = convert.command_to_proto(m.Command(seq=1, body=COMMANDS[0])).DESCRIPTOR.oneofs
    kinds = {f.name for o in oneof for f in o.fields}
    sent = {
        convert.command_to_proto(m.Command(seq=1, body=b)).WhichOneof("command") for b in COMMANDS
    }
    assert sent == kinds


@pytest.mark.parametrize("body", REPORTS, ids=lambda b: type(b).__name__)
def test_reports(body: m.ReportBody) -> None:
    _check(
        m.Report(member_id="m1", refit_id="r1", body=body),
        convert.report_to_proto,
        convert.report_from_proto,
    )


def test_every_report_kind_has_a_sample() -> None:
    def kind(b: m.ReportBody) -> str | None:
        msg = convert.report_to_proto(m.Report(member_id="m", refit_id="r", body=b))
        return msg.WhichOneof("report")

    oneofs = convert.report_to_proto(m.Report("m", "r", REPORTS[0])).DESCRIPTOR.oneofs
    assert {kind(b) for b in REPORTS} == {f.name for o in oneofs for f in o.fields}


def test_refit() -> None:
    _check(REFIT, convert.refit_to_proto, convert.refit_from_proto)


def test_topology() -> None:
    _check(TOPOLOGY, convert.topology_to_proto, convert.topology_from_proto)


def test_rank_plan() -> None:
    _check(PLAN, convert.rank_plan_to_proto, convert.rank_plan_from_proto)


def test_transfer_config() -> None:
    _check(CONFIG, convert.config_to_proto, convert.config_from_proto)
    unchecked = dataclasses.replace(CONFIG, verify_checksums=False)
    assert convert.config_from_proto(convert.config_to_proto(unchecked)) == unchecked


def test_layout() -> None:
    b = LayoutBuilder()
    b.add(SPEC_W, 1, ((0, 4), (0, 4)))
    b.add(SPEC_B, 1, ((2, 6),))
    layout = b.build()
    msg = convert.layout_to_proto(layout, 1)
    assert not list(_unset(msg))
    assert convert.layout_from_proto(msg, 1).digest == layout.digest


@pytest.mark.parametrize(
    ("enum", "proto_enum", "from_proto"),
    [
        (Role, enums.cpb.Role, convert.role_from_proto),
        (Backend, enums.cpb.Backend, convert.backend_from_proto),
        (MemberState, enums.cpb.MemberState, convert.member_state_from_proto),
        (RefitState, enums.cpb.RefitState, convert.refit_state_from_proto),
    ],
)
def test_every_proto_enum_value_has_a_member(enum: Any, proto_enum: Any, from_proto: Any) -> None:
    numbers = [v.number for v in proto_enum.DESCRIPTOR.values if v.number]
    assert {from_proto(n) for n in numbers} == set(enum)
