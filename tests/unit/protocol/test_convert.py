"""Protobuf ↔ domain conversion: round trips, and malformed input named by field path."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.errors import InvalidArgument, LayoutError
from refitplane.protocol import Backend, MemberState, RefitState, Role, convert
from refitplane.protocol import messages as m
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.planner import build_plan

pytestmark = pytest.mark.unit


def _layout(rank: int, rows: tuple[int, int]):
    b = LayoutBuilder()
    b.add(TensorSpec.create("w", (8, 4), "bfloat16"), rank, (rows, (0, 4)))
    b.add(TensorSpec.create("s", (), "float32"), rank, ())
    return b.build()


@pytest.mark.parametrize("enum", [Role, MemberState, RefitState, Backend])
def test_enums_round_trip(enum):
    to_proto = {
        Role: convert.role_to_proto,
        MemberState: convert.member_state_to_proto,
        RefitState: convert.refit_state_to_proto,
        Backend: convert.backend_to_proto,
    }[enum]
    from_proto = {
        Role: convert.role_from_proto,
        MemberState: convert.member_state_from_proto,
        RefitState: convert.refit_state_from_proto,
        Backend: convert.backend_from_proto,
    }[enum]
    for value in enum:
        assert from_proto(to_proto(value)) is value
    with pytest.raises(InvalidArgument) as err:
        from_proto(0, field="x.role")
    assert err.value.field == "x.role"
    assert "UNSPECIFIED" in err.value.message
    with pytest.raises(InvalidArgument):
        from_proto(99)


def test_layout_round_trip_keeps_digest_and_zero_d_tensors():
    layout = _layout(3, (2, 6))
    msg = convert.layout_to_proto(layout, 3)
    assert convert.layout_from_proto(msg, 3).digest == layout.digest
    # Another rank's part of a layout is not this rank's.
    assert not convert.layout_to_proto(layout, 0).tensors


def test_layout_limit(monkeypatch):
    monkeypatch.setattr(convert.reshard, "MAX_LAYOUT_TENSORS", 1)
    msg = convert.layout_to_proto(_layout(0, (0, 8)), 0)
    with pytest.raises(LayoutError) as err:
        convert.layout_from_proto(msg, 0)
    assert err.value.field == "layout.tensors"


def test_rank_plan_and_config_round_trip():
    source = _layout(0, (0, 8))
    target = LayoutBuilder()
    target.merge(_layout(1, (0, 4)))
    target.merge(_layout(2, (4, 8)))
    plan = build_plan(source, target.build())
    for rank in (0, 1, 2):
        rp = plan.rank_plan(rank)
        back = convert.rank_plan_from_proto(convert.rank_plan_to_proto(rp))
        assert back == rp
    config = TransferConfig(bucket_bytes=1024, num_channels=3, max_inflight_bytes=4096, timeout_s=9)
    assert convert.config_from_proto(convert.config_to_proto(config)) == config


def test_plan_piece_index_out_of_range_names_the_field():
    msg = cpb.RankPlan(
        rank=0,
        specs=[cpb.TensorSpec(name="w", shape=[4], dtype="float32")],
        sends=[cpb.Link(src=0, dst=1, nbytes=4, pieces=[cpb.Piece(tensor=5, box=cpb.Box())])],
    )
    with pytest.raises(InvalidArgument) as err:
        convert.rank_plan_from_proto(msg)
    assert err.value.field == "plan.sends[0].pieces[0].tensor"


_commands = st.one_of(
    st.builds(
        m.CreateRendezvousCmd,
        epoch=st.integers(0, 2**40),
        backend=st.sampled_from(Backend),
        group_size=st.integers(1, 1024),
        num_channels=st.integers(1, 64),
    ),
    st.builds(
        m.JoinGroupCmd,
        epoch=st.integers(0, 2**40),
        backend=st.sampled_from(Backend),
        group_rank=st.integers(0, 1023),
        group_size=st.integers(1, 1024),
        num_channels=st.integers(1, 64),
        rendezvous=st.binary(max_size=256),
        timeout_s=st.floats(0.1, 1000),
    ),
    st.builds(m.LeaveGroupCmd, epoch=st.integers(0, 2**40), abort=st.booleans()),
    st.builds(
        m.PrepareRefitCmd,
        refit_id=st.text(max_size=20),
        version=st.integers(0, 2**50),
        epoch=st.integers(0, 2**40),
        pause_mode=st.sampled_from(["", "keep", "wait", "abort"]),
        plan_digest=st.text(alphabet="0123456789abcdef", max_size=64),
        plan_rank=st.integers(0, 2**20),
    ),
    st.builds(
        m.StartTransferCmd,
        refit_id=st.text(max_size=20),
        version=st.integers(0, 2**50),
        ranks_verified=st.booleans(),
    ),
    st.builds(
        m.AbortRefitCmd,
        refit_id=st.text(max_size=20),
        reason=st.text(max_size=20),
        message=st.text(max_size=50),
    ),
    st.builds(
        m.RanksVerifiedCmd,
        refit_id=st.text(max_size=20),
        version=st.integers(0, 2**50),
        member_ids=st.frozensets(st.text(max_size=20), max_size=4),
    ),
)


@given(body=_commands, seq=st.integers(0, 2**40))
def test_commands_round_trip(body, seq):
    cmd = m.Command(seq=seq, body=body)
    assert convert.command_from_proto(convert.command_to_proto(cmd)) == cmd


_reports = st.one_of(
    st.builds(m.RendezvousReady, epoch=st.integers(0, 2**40), rendezvous=st.binary(max_size=64)),
    st.builds(m.GroupJoined, epoch=st.integers(0, 2**40)),
    st.just(m.Prepared()),
    st.builds(
        m.Progress,
        bytes_sent=st.integers(0, 2**50),
        bytes_received=st.integers(0, 2**50),
        bytes_total=st.integers(0, 2**50),
    ),
    st.integers(0, 1000).flatmap(
        lambda total: st.builds(
            m.TransferDone,
            bytes_sent=st.integers(0, 2**50),
            bytes_received=st.integers(0, 2**50),
            seconds=st.floats(0, 1e6),
            tensors_verified=st.integers(0, total),
            tensors_total=st.just(total),
        )
    ),
    st.builds(m.ReplicaUpdated, version=st.integers(0, 2**50)),
    st.builds(
        m.PlanMissing,
        plan_digest=st.text(alphabet="0123456789abcdef", min_size=1, max_size=64),
        plan_rank=st.integers(0, 2**20),
        message=st.text(max_size=50),
    ),
    st.builds(
        m.Failure,
        reason=st.text(min_size=1, max_size=20),
        message=st.text(max_size=50),
        weights_modified=st.booleans(),
        epoch=st.integers(0, 2**40),
    ),
)


@given(body=_reports, refit_id=st.text(max_size=20))
def test_reports_round_trip(body, refit_id):
    report = m.Report(member_id="m", refit_id=refit_id, body=body)
    assert convert.report_from_proto(convert.report_to_proto(report)) == report


def test_malformed_reports():
    with pytest.raises(InvalidArgument) as err:
        convert.report_from_proto(apb.ReportRequest(member_id="m"))
    assert err.value.field == "report"
    bad = apb.ReportRequest(
        member_id="m", transfer_done=apb.TransferDone(tensors_verified=3, tensors_total=2)
    )
    with pytest.raises(InvalidArgument) as err:
        convert.report_from_proto(bad)
    assert err.value.field == "transfer_done.tensors_verified"
    nan = apb.ReportRequest(member_id="m", transfer_done=apb.TransferDone(seconds=float("nan")))
    with pytest.raises(InvalidArgument):
        convert.report_from_proto(nan)


def test_registration_round_trip():
    info = m.MemberInfo(
        job="j",
        role=Role.GENERATOR,
        rank=1,
        world_size=2,
        replica_id="r",
        host="h",
        device="cuda:1",
        labels={"a": "b"},
        version=7,
    )
    assert convert.register_from_proto(convert.register_to_proto(info)) == info
    with pytest.raises(InvalidArgument) as err:
        convert.register_from_proto(apb.RegisterRequest(job="j"))
    assert err.value.field == "role"


def test_prepare_refit_from_a_coordinator_that_sends_only_bodies_names_the_plan():
    plan = RankPlan(rank=3, specs={}, sends=(), recvs=(), plan_digest="ab" * 32)
    cmd = m.Command(seq=1, body=m.PrepareRefitCmd(refit_id="r", version=1, epoch=1, plan=plan))
    back = convert.command_from_proto(convert.command_to_proto(cmd)).body
    assert isinstance(back, m.PrepareRefitCmd)
    assert back.plan_key == ("ab" * 32, 3)


def test_plan_missing_must_name_a_plan():
    request = apb.ReportRequest(member_id="m", refit_id="r")
    request.plan_missing.SetInParent()
    with pytest.raises(InvalidArgument) as err:
        convert.report_from_proto(request)
    assert err.value.field == "plan_missing.plan_digest"
