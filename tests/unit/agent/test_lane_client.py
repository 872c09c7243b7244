"""The agent's end of the control lane without a coordinator: where it dials, what it makes
of a lane it cannot reach (once at WARNING per outage, then quietly, retried later), and
the framing's limits as the agent reads them."""

from __future__ import annotations

import logging
import struct

import pytest

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.agent.lane import ControlLane, lane_host
from refitplane.errors import InvalidArgument
from refitplane.protocol import lane as wire
from refitplane.testing.child_processes import free_port

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("refit-coordinator:50051", "refit-coordinator"),
        ("127.0.0.1:50051", "127.0.0.1"),
        ("[::1]:50051", "::1"),
        ("dns:///refit.example.com:443", "refit.example.com"),
        ("unix:/run/refit.sock", None),
        ("no-port", None),
    ],
)
def test_the_lane_is_dialled_on_the_grpc_targets_host(target: str, host: str | None) -> None:
    assert lane_host(target) == host


def test_an_unreachable_lane_is_said_once_and_retried_later(caplog) -> None:
    lane = ControlLane("127.0.0.1:50051", tls_ca=None, token=None, timeout_s=5, enabled=True)
    lane.port = free_port()  # nothing listens there
    try:
        assert lane.usable()
        with caplog.at_level(logging.DEBUG, logger="refitplane.agent.lane"):
            assert not lane.open("m1", "credential", lambda command: None)
            assert not lane.usable()  # not before RETRY_AFTER_S
            assert not lane.open("m1", "credential", lambda command: None)
        said = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]
        assert lane.send("m1", apb.ReportRequest(member_id="m1")) is None  # gRPC takes it
        assert lane.opened == 0
    finally:
        lane.shutdown()


def test_a_lane_without_a_host_is_off() -> None:
    lane = ControlLane("unix:/run/refit.sock", tls_ca=None, token=None, timeout_s=5, enabled=True)
    lane.port = 50052
    assert not lane.enabled
    assert not lane.usable()


def test_frames_are_refused_from_their_header_and_must_be_lane_frames() -> None:
    ok = wire.encode(apb.LaneFrame(hello=apb.LaneHello(member_id="m")))
    length = wire.frame_length(ok[:4], wire.MAX_AGENT_FRAME_BYTES, "agent")
    assert wire.decode(ok[4 : 4 + length], "agent").hello.member_id == "m"
    with pytest.raises(InvalidArgument, match="announces 70000 bytes, above its limit of 65600"):
        wire.frame_length(struct.pack("!I", 70_000), wire.MAX_AGENT_FRAME_BYTES, "agent")
    with pytest.raises(InvalidArgument, match=r"not a refit\.v1\.LaneFrame"):
        wire.decode(b"\xff\xff\xff\xff", "agent")
    with pytest.raises(InvalidArgument, match="carries nothing"):
        wire.decode(b"", "agent")


def test_a_lane_error_comes_back_as_the_domain_error() -> None:
    frame = wire.error_frame(InvalidArgument("bad", field="report"), seq=3).error
    error = wire.error_of(frame)
    assert isinstance(error, InvalidArgument)
    assert (error.message, error.field, frame.seq) == ("bad", "report", 3)
    unknown = wire.error_of(apb.LaneError(reason="SOMETHING_NEW", message="m"))
    assert unknown.reason == "SOMETHING_NEW"
