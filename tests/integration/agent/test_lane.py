"""The control lane (docs/coordinator.md, "The control lane") against a real coordinator on
loopback: commands and reports go on it (no gRPC stream, no unary Report), over TLS too;
agents with REFIT_LANE=0 or a lane they cannot reach use gRPC and refits still commit; after
a restart on the same ports the agents come back on the lane; and a raw socket gets a clear
refusal, never a crash, for each way a caller can break the lane's rules."""

from __future__ import annotations

import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.agent.lane import RETRY_AFTER_S as LANE_RETRY_AFTER_S
from refitplane.protocol import lane as wire
from refitplane.protocol.channel import MEMBER_CREDENTIAL_KEY
from refitplane.testing.child_processes import free_port
from tests.integration.agent.report_paths import commit, reports, three_refits
from tests.integration.conftest import wait_until
from tests.support.tls_certs import certificate, new_key, write_certificate, write_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _sample(coord: Any, name: str, labels: dict[str, str] | None = None) -> float:
    value = coord.core.metrics.registry.get_sample_value(name, labels or {})
    return value or 0.0


def _credential(member: Any) -> str:
    return str(dict(member.session.metadata)[MEMBER_CREDENTIAL_KEY])


class RawLane:
    """A caller speaking the lane's framing by hand."""

    def __init__(self, port: int, *, tls_ca: Path | None = None) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if tls_ca is not None:
            sock = ssl.create_default_context(cafile=str(tls_ca)).wrap_socket(
                sock, server_hostname="localhost"
            )
        self.sock = sock

    def send(self, frame: apb.LaneFrame) -> None:
        self.sock.sendall(wire.encode(frame))

    def hello(self, member_id: str, credential: str, token: str = "") -> None:
        self.send(
            apb.LaneFrame(
                hello=apb.LaneHello(member_id=member_id, token=token, member_credential=credential)
            )
        )

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def read(self, timeout_s: float = 10.0) -> apb.LaneFrame | None:
        """The next frame; None once the coordinator closed the lane."""
        self.sock.settimeout(timeout_s)
        try:
            header = self._exactly(4)
            if header is None:
                return None
            body = self._exactly(struct.unpack("!I", header)[0])
        except ConnectionResetError:
            return None
        return None if body is None else wire.decode(body, "coordinator")

    def closed(self, timeout_s: float = 10.0) -> bool:
        """Whether the coordinator closes the lane (reading past whatever it still sent)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.read(timeout_s) is None:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def _refusal(lane: RawLane) -> apb.LaneError:
    """The lane's closing error frame, after which it is closed."""
    frame = lane.read()
    assert frame is not None
    assert frame.WhichOneof("frame") == "error", frame
    assert frame.error.seq == 0
    assert lane.closed()
    return frame.error


def _prepared(member_id: str, seq: int) -> apb.LaneFrame:
    report = apb.ReportRequest(
        member_id=member_id, refit_id="no-such-refit", prepared=apb.Prepared()
    )
    return apb.LaneFrame(report=apb.StreamReportsRequest(report=report, seq=seq))


def test_commands_and_reports_go_on_the_lane(coordinator, sim_cluster):
    cluster = three_refits(coordinator, sim_cluster)
    # Group formation, Prepared, TransferDone, ReplicaUpdated: all on the lane.
    assert reports(coordinator, "UNARY") == 0
    assert reports(coordinator, "STREAM") == 0
    assert reports(coordinator, "LANE") >= 6 * len(cluster.members)
    assert _sample(coordinator, "refit_control_lanes") == len(cluster.members)
    for m in cluster.members:
        assert m.session.lane.opened == 1, m.member_id
        assert m.session.lane.sent >= 6, m.member_id
        assert m.session.streams_opened == 1  # the lane, no StreamCommands
        assert m.session.reports.sent == 0


def test_lane_off_on_the_agents_uses_grpc(coordinator, sim_cluster, monkeypatch):
    monkeypatch.setenv("REFIT_LANE", "0")
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a")
    commit(cluster.client())
    assert reports(coordinator, "LANE") == 0
    assert reports(coordinator, "STREAM") > 0
    assert _sample(coordinator, "refit_control_lanes") == 0


def test_lane_over_tls(coordinator_factory, sim_cluster, tmp_path):
    key = new_key()
    cert = write_certificate(
        tmp_path / "tls.crt", certificate(key, "localhost", ca=True, localhost=True)
    )
    coord = coordinator_factory(
        tls_cert_file=str(cert),
        tls_key_file=str(write_key(tmp_path / "tls.key", key)),
        auth_token="tls-token",
    )
    cluster = sim_cluster(coord, token="tls-token", tls_ca=cert)
    cluster.trainers(world=1)
    cluster.replica("a")
    commit(cluster.client())
    assert reports(coord, "LANE") > 0
    assert reports(coord, "STREAM") == reports(coord, "UNARY") == 0
    # Plaintext on a TLS lane: no answer, closed.
    plain = RawLane(coord.server.lane_port)
    plain.send(_prepared("x", 1))
    assert plain.closed()
    plain.close()


def test_agents_come_back_on_the_lane_after_a_restart(redis_url, coordinator_factory, sim_cluster):
    lane_port = free_port()
    first = coordinator_factory(redis_url, lane_port=lane_port)
    cluster = sim_cluster(first)
    cluster.trainers(world=1)
    cluster.replica("a")
    commit(cluster.client())
    first.stop()
    second = coordinator_factory(redis_url, grpc_port=first.server.grpc_port, lane_port=lane_port)
    # Down, the lanes closed and the agents went to gRPC; each finds the lane again within
    # LANE_RETRY_AFTER_S, and the coordinator ends its gRPC stream.
    wait_until(
        lambda: _sample(second, "refit_control_lanes") == len(cluster.members),
        timeout_s=3 * LANE_RETRY_AFTER_S,
        what="the agents back on the lane",
    )
    before = reports(second, "STREAM") + reports(second, "UNARY")
    commit(cluster.client())
    assert reports(second, "LANE") > 0
    assert reports(second, "STREAM") + reports(second, "UNARY") == before


def test_a_lane_that_cannot_be_reached_falls_back_to_grpc(
    redis_url, coordinator_factory, sim_cluster
):
    # The agents learned the first coordinator's lane port at registration; the second,
    # on the same store and gRPC port, listens on another: the agents do not re-register,
    # find nothing at the old port and carry on over gRPC.
    first = coordinator_factory(redis_url)
    cluster = sim_cluster(first)
    cluster.trainers(world=1)
    cluster.replica("a")
    commit(cluster.client())
    first.stop()
    second = coordinator_factory(redis_url, grpc_port=first.server.grpc_port)
    assert second.server.lane_port != first.server.lane_port
    commit(cluster.client())
    assert reports(second, "LANE") == 0
    assert reports(second, "STREAM") + reports(second, "UNARY") > 0


def test_a_lane_refuses_callers_who_break_its_rules(coordinator_factory, sim_cluster):
    coord = coordinator_factory(auth_token="secret")
    port = coord.server.lane_port
    cluster = sim_cluster(coord, token="secret")
    own = cluster.trainers(world=1)[0]
    victim = cluster.replica("a")[0]
    refused = "refit_control_lane_refusals_total"

    # No token, a wrong token: UNAUTHENTICATED on the hello, nothing of the member's given.
    for token in ("", "not-the-token"):
        lane = RawLane(port)
        lane.hello(own.member_id, _credential(own), token=token)
        error = _refusal(lane)
        assert (error.reason, error.field) == ("UNAUTHENTICATED", "authorization")
    assert _sample(coord, refused, {"reason": "UNAUTHENTICATED"}) == 2
    # The token, but another member's id with this member's credential.
    lane = RawLane(port)
    lane.hello(victim.member_id, _credential(own), token="secret")
    assert _refusal(lane).reason == "PERMISSION_DENIED"
    # A report before any hello.
    lane = RawLane(port)
    lane.send(_prepared(own.member_id, 1))
    error = _refusal(lane)
    assert (error.reason, error.field) == ("INVALID_ARGUMENT", "frame.hello")
    # A length above the limit: refused from the header, the body never read.
    lane = RawLane(port)
    lane.sock.sendall(struct.pack("!I", 1 << 30))
    error = _refusal(lane)
    assert error.reason == "INVALID_ARGUMENT"
    assert "above its limit" in error.message
    # Bytes that are no LaneFrame.
    lane = RawLane(port)
    lane.sock.sendall(struct.pack("!I", 4) + b"\xff\xff\xff\xff")
    assert "not a refit.v1.LaneFrame" in _refusal(lane).message

    # A proper lane for `own`: its reports are answered by seq (not accepted: no such refit)
    # and the lane stays open; a report naming another member ends it.
    lane = RawLane(port)
    lane.hello(own.member_id, _credential(own), token="secret")
    lane.send(_prepared(own.member_id, 7))
    answer = lane.read()
    while answer is not None and answer.WhichOneof("frame") == "command":
        answer = lane.read()  # the member's own commands, if any were queued
    assert answer is not None
    assert answer.WhichOneof("frame") == "answer"
    assert (answer.answer.seq, answer.answer.accepted) == (7, False)
    lane.send(_prepared(victim.member_id, 8))
    error = _refusal(lane)
    assert (error.reason, error.field) == ("PERMISSION_DENIED", "report.member_id")
    # The coordinator took all of that in its stride: refits still commit.
    commit(cluster.client())


def test_a_silent_connection_is_closed_after_the_hello_timeout(coordinator):
    lane = RawLane(coordinator.server.lane_port)
    started = time.monotonic()
    assert lane.closed(timeout_s=wire.HELLO_TIMEOUT_S + 5)
    assert time.monotonic() - started >= wire.HELLO_TIMEOUT_S - 0.5
    assert _sample(coordinator, "refit_control_lane_refusals_total", {"reason": "HELLO_TIMEOUT"})


def test_agents_dial_a_remapped_lane_at_refit_lane_target(coordinator, sim_cluster, monkeypatch):
    """A lane reached at another address (a proxy, a NodePort, a load balancer's port):
    REFIT_LANE_TARGET names it, and the agents dial it there."""
    from tests.support.tcp_proxy import TcpProxy

    proxy = TcpProxy("127.0.0.1", coordinator.server.lane_port)
    try:
        monkeypatch.setenv("REFIT_LANE_TARGET", proxy.target)
        cluster = sim_cluster(coordinator)
        cluster.trainers(world=1)
        cluster.replica("a")
        commit(cluster.client())
        assert reports(coordinator, "LANE") > 0
        assert reports(coordinator, "STREAM") == reports(coordinator, "UNARY") == 0
        # Every agent's lane runs through the proxy: two ends of a connection per member.
        assert proxy.cut() == 2 * len(cluster.members)
    finally:
        proxy.close()
