"""Reports on a stream each member holds open (AgentService.StreamReports, issue 23), against
a real coordinator on loopback: reports go on the stream (no unary Report), a stream carries
one member's reports only, a stream that breaks mid-refit hands its report to the unary
path, and reports reach a restarted coordinator (unary first, the stream again after). The
coordinators here have no control lane (which would carry the reports instead: test_lane.py)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane.agent.report_stream import RETRY_AFTER_S
from refitplane.agent.simulated import Behaviour
from refitplane.client import RefitClient
from refitplane.protocol import RefitState
from refitplane.protocol.channel import MAX_STREAM_REPORT_BYTES, MEMBER_CREDENTIAL_KEY
from tests.integration.agent.report_paths import commit, reports, three_refits
from tests.integration.conftest import SimCluster, wait_until
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NO_LANE = {"lane_port": None}


@pytest.fixture
def coordinator(coordinator_factory: Any) -> Any:
    return coordinator_factory(**NO_LANE)


def test_reports_go_on_the_open_stream(coordinator, sim_cluster):
    cluster = three_refits(coordinator, sim_cluster)
    # Group formation, Prepared, TransferDone, ReplicaUpdated: none of them unary.
    assert reports(coordinator) == 0
    assert reports(coordinator, "STREAM") >= 6 * len(cluster.members)
    for m in cluster.members:
        assert m.session.reports.sent >= 6, m.member_id
        assert m.session.reports.fell_back == 0


def test_report_stream_off_sends_every_report_unary(coordinator, sim_cluster, monkeypatch):
    monkeypatch.setenv("REFIT_REPORT_STREAM", "0")  # the A/B switch
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a")
    commit(cluster.client())
    assert reports(coordinator) > 0
    assert all(m.session.reports.sent == 0 for m in cluster.members)


def _stream(stub: Any, metadata: Any, *reports: apb.ReportRequest) -> tuple[Any, list[bool], str]:
    """Send `reports` on one StreamReports stream: how it ended, the answers, the field."""
    requests = [apb.StreamReportsRequest(report=r, seq=i + 1) for i, r in enumerate(reports)]
    call = stub.StreamReports(iter(requests), metadata=metadata, timeout=5)
    answers: list[bool] = []
    try:
        for i, answer in enumerate(call):
            assert answer.seq == i + 1
            answers.append(answer.accepted)
    except grpc.RpcError as exc:
        field = dict(exc.trailing_metadata() or ()).get("refit-field", "")
        return exc.code(), answers, str(field)
    return grpc.StatusCode.OK, answers, ""


def _prepared(member_id: str) -> apb.ReportRequest:
    return apb.ReportRequest(member_id=member_id, refit_id="no-such-refit", prepared=apb.Prepared())


def test_a_stream_carries_one_members_reports_only(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    own = cluster.trainers(world=1)[0]
    victim = cluster.replica("a")[0]
    with grpc.insecure_channel(coordinator.grpc_target) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        meta = own.session.metadata
        # Its own reports: answered in order (not accepted: no such refit).
        assert _stream(stub, meta, _prepared(own.member_id), _prepared(own.member_id)) == (
            grpc.StatusCode.OK,
            [False, False],
            "",
        )
        # Bound to its member by the first report: naming another member ends the stream.
        code, answers, field = _stream(
            stub, meta, _prepared(own.member_id), _prepared(victim.member_id)
        )
        assert (code, answers, field) == (
            grpc.StatusCode.PERMISSION_DENIED,
            [False],
            "report.member_id",
        )
        # Another member's id first, with this member's credential: refused.
        code, answers, _ = _stream(stub, meta, _prepared(victim.member_id))
        assert (code, answers) == (grpc.StatusCode.PERMISSION_DENIED, [])
        # No credential at all.
        code, _, _ = _stream(stub, (), _prepared(victim.member_id))
        assert code is grpc.StatusCode.UNAUTHENTICATED
        # A wrong one.
        wrong = ((MEMBER_CREDENTIAL_KEY, "not-the-credential"),)
        code, _, _ = _stream(stub, wrong, _prepared(victim.member_id))
        assert code is grpc.StatusCode.PERMISSION_DENIED
        # Above the per-report limit: refused naming the report (agents send those unary).
        big = apb.ReportRequest(
            member_id=own.member_id,
            refit_id="no-such-refit",
            failure=apb.Failure(reason="AGENT_ERROR", message="x" * (MAX_STREAM_REPORT_BYTES + 1)),
        )
        code, _, field = _stream(stub, meta, big)
        assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "report")
    # The victim was not touched: its next refit commits.
    commit(cluster.client())


def test_a_report_at_the_limit_goes_unary_not_refused(coordinator, sim_cluster):
    # The coordinator measures the wrapped request (report + seq) against the limit: a report
    # of exactly MAX_STREAM_REPORT_BYTES must go by the unary Report, not be refused
    # INVALID_ARGUMENT on the stream and raised to the caller.
    cluster = sim_cluster(coordinator)
    (trainer,) = cluster.trainers(world=1)
    session = trainer.session

    def size(n: int) -> int:
        return apb.ReportRequest(
            member_id=session.member_id,
            refit_id="no-such-refit",
            failure=apb.Failure(reason="AGENT_ERROR", message="x" * n),
        ).ByteSize()

    n = MAX_STREAM_REPORT_BYTES
    while size(n) > MAX_STREAM_REPORT_BYTES:  # the lengths' varints grow with it
        n -= 1
    assert size(n) == MAX_STREAM_REPORT_BYTES
    message = "x" * n
    unary_before = reports(coordinator)
    assert session.report_failure("no-such-refit", "AGENT_ERROR", message) is False
    assert reports(coordinator) == unary_before + 1


def test_a_stream_broken_mid_refit_hands_the_report_to_unary(coordinator_factory):
    # The cut breaks every agent connection: each reconnects with gRPC's backoff (1 s, then
    # 1.6 s, ...). The default 5 s TRANSFERRING bound failed this once on a loaded CI box
    # (both ranks still reconnecting), and leases (3 s) renew through the same channels;
    # the test is about the fallback, not those bounds.
    coordinator = coordinator_factory(transfer_timeout_s=30.0, lease_ttl_s=15.0, **NO_LANE)
    proxy = TcpProxy("127.0.0.1", coordinator.server.grpc_port)
    cluster = SimCluster(proxy.target)
    try:
        # The trainer holds its TransferDone back while its connection is cut.
        trainer = cluster.trainers(world=1, behaviour=Behaviour(delay_s={"start_transfer": 1.0}))[0]
        cluster.replica("a")
        client = RefitClient(coordinator.grpc_target)  # not through the proxy
        commit(client)
        assert trainer.session.reports.sent > 0
        unary_before = reports(coordinator)
        refit_id = client.trigger("job").refit_id
        wait_until(
            lambda: client.get(refit_id).state is RefitState.TRANSFERRING, what="TRANSFERRING"
        )
        assert proxy.cut() > 0
        refit = client.wait(refit_id, timeout_s=20)
        assert refit.state is RefitState.COMMITTED, f"{refit.reason}: {refit.message}"
        assert trainer.session.reports.fell_back >= 1
        assert reports(coordinator) > unary_before
        # After RETRY_AFTER_S the stream is opened again and carries the reports.
        time.sleep(RETRY_AFTER_S)
        trainer.agent.behaviour = Behaviour()
        sent = trainer.session.reports.sent
        commit(client)
        assert trainer.session.reports.sent > sent
        client.close()
    finally:
        cluster.close()
        proxy.close()


def test_reports_reach_a_restarted_coordinator(redis_url, coordinator_factory, sim_cluster):
    first = coordinator_factory(redis_url, **NO_LANE)
    cluster = sim_cluster(first)
    cluster.trainers(world=1)
    cluster.replica("a", sidecar=True)
    client = cluster.client()
    commit(client)
    ids = {m.member_id for m in cluster.members}
    first.stop()
    second = coordinator_factory(redis_url, grpc_port=first.server.grpc_port, **NO_LANE)
    wait_until(
        lambda: all(second.core.outbox.connected(i) for i in ids), what="command streams back"
    )
    # Their open report streams died with the first coordinator: these reports go unary...
    commit(client)
    assert {m.member_id for m in cluster.members} == ids
    assert all(m.session.registrations == 1 for m in cluster.members)
    # ...and once RETRY_AFTER_S passed, on a new stream to the second one.
    time.sleep(RETRY_AFTER_S)
    unary = reports(second)
    commit(client)
    assert reports(second) == unary


def test_a_transfer_done_sent_again_is_applied_once(coordinator, sim_cluster):
    """What a lost answer leads to (the stream broke after the coordinator applied the
    report, and the unary path sends it again): the second copy changes nothing."""
    cluster = sim_cluster(coordinator)
    trainer = cluster.trainers(world=1)[0]
    # The receiver reports late, so both copies land while the refit is TRANSFERRING.
    cluster.replica("a", behaviour=Behaviour(delay_s={"start_transfer": 0.5}))
    client = cluster.client()
    once = commit(client).bytes_on_wire
    assert once > 0
    send = trainer.session.report_transfer_done

    def twice(*args: Any, **kwargs: Any) -> bool:
        send(*args, **kwargs)
        return bool(send(*args, **kwargs))

    trainer.session.report_transfer_done = twice
    assert commit(client).bytes_on_wire == once
