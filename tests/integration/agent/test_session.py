"""The agent session runtime against a real coordinator: registration, leases, layouts,
command ordering, immediate aborts, automatic failure reports, reconnects."""

from __future__ import annotations

import threading
import time

import pytest

from refitplane.agent import AgentSession, MemberInfo, NullHandler
from refitplane.agent.simulated import Behaviour
from refitplane.errors import ChecksumMismatch, InvalidArgument, Unavailable
from refitplane.protocol import MemberState, RefitState, Role
from refitplane.protocol.messages import (
    AbortRefitCmd,
    CreateRendezvousCmd,
    JoinGroupCmd,
    LeaveGroupCmd,
    PrepareRefitCmd,
    StartTransferCmd,
)
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.plan import RankPlan
from refitplane.testing.child_processes import free_port
from tests.integration.conftest import row_layout, wait_until

pytestmark = pytest.mark.integration


def test_commands_arrive_in_order_as_domain_types(coordinator_factory, sim_cluster):
    coord = coordinator_factory(bucket_bytes=4096, max_inflight_bytes=8192, num_channels=3)
    cluster = sim_cluster(coord)
    trainer = cluster.trainers(world=1)[0]
    gen = cluster.replica("a")[0]
    client = cluster.client()
    refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert refit.state is RefitState.COMMITTED

    kinds = [type(c) for c in trainer.agent.commands]
    assert kinds == [CreateRendezvousCmd, JoinGroupCmd, PrepareRefitCmd, StartTransferCmd]
    assert [type(c) for c in gen.agent.commands] == [
        JoinGroupCmd,
        PrepareRefitCmd,
        StartTransferCmd,
    ]
    prepare = gen.agent.received(PrepareRefitCmd)[0]
    assert isinstance(prepare.plan, RankPlan)
    assert prepare.plan.recv_bytes == refit.bytes_total
    assert prepare.config == TransferConfig(
        bucket_bytes=4096, num_channels=3, max_inflight_bytes=8192, timeout_s=5.0
    )
    join = gen.agent.received(JoinGroupCmd)[0]
    assert join.rendezvous.startswith(b"sim-rendezvous:1:")
    assert (join.group_rank, join.group_size, join.num_channels) == (1, 2, 3)


class _Raising(NullHandler):
    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.session: AgentSession | None = None

    def on_join_group(self, cmd: JoinGroupCmd) -> None:
        assert self.session is not None
        self.session.report_group_joined(cmd.epoch)

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        assert self.session is not None
        self.session.report_prepared(cmd.refit_id)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        raise self.exc


class _Modified(ChecksumMismatch):
    weights_modified = True


@pytest.mark.parametrize(
    ("exc", "reason", "text", "degraded"),
    [
        (_Modified("chunk 3 of tensor 'w' differs"), "CHECKSUM_MISMATCH", "chunk 3", True),
        (RuntimeError("segfault-ish"), "AGENT_ERROR", "RuntimeError: segfault-ish", True),
    ],
)
def test_handler_exceptions_become_failure_reports(
    coordinator, sim_cluster, exc, reason, text, degraded
):
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    handler = _Raising(exc)
    info = MemberInfo(job="job", role=Role.GENERATOR, replica_id="a")
    session = AgentSession(coordinator.grpc_target, info, handler)
    handler.session = session
    with session:
        session.publish_layout(row_layout(0, 1))
        client = cluster.client()
        refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
        replica = client.topology("job").replicas[0]
    assert (replica.state is MemberState.DEGRADED) == degraded
    assert refit.state is RefitState.FAILED
    assert refit.reason == reason
    assert text in refit.message
    assert "replica 'a' rank 0" in refit.message


def test_abort_reaches_a_busy_agent_at_once(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    trainer = cluster.trainers(world=1, behaviour=Behaviour(hold_transfer_s=30))[0]
    cluster.replica("a")
    seen: list[str] = []
    original = trainer.agent.on_abort_now

    def record_thread(cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        seen.append(threading.current_thread().name)
        original(cmd)

    trainer.agent.on_abort_now = record_thread  # type: ignore[method-assign]
    client = cluster.client()
    refit = client.trigger("job")
    wait_until(lambda: client.get(refit.refit_id).state is RefitState.TRANSFERRING)
    client.cancel(refit.refit_id)
    # The worker thread is blocked in the held transfer; the abort came via the stream thread
    # and released it, then the in-order AbortRefit ran on the worker (the wait is bounded:
    # a worker still blocked never receives it).
    wait_until(lambda: trainer.agent.received(AbortRefitCmd), timeout_s=5)
    assert seen == ["refit-agent-lane"]  # the thread that reads the commands, not the worker


def test_an_undecodable_command_is_skipped_and_the_stream_stays(coordinator, sim_cluster):
    """A command the agent cannot decode (one a newer coordinator added) is logged and
    skipped: the stream stays open and the command after it arrives (reopening the stream
    would not bring the skipped one back)."""
    gen = sim_cluster(coordinator).replica("a")[0]
    outbox = coordinator.core.outbox
    # The coordinator can see the stream before the agent's thread counts it as opened.
    wait_until(
        lambda: outbox.connected(gen.member_id) and gen.session.streams_opened >= 1,
        what="the command stream, counted by the agent",
    )
    opened = gen.session.streams_opened
    after = AbortRefitCmd(refit_id="r", reason="TEST", message="after the unknown one")

    async def send() -> None:
        outbox.send(gen.member_id, object())  # the converter sets no command: an empty body
        outbox.send(gen.member_id, after)

    coordinator.call(send())
    wait_until(lambda: gen.agent.aborted_now == [after], what="the command after it")
    assert gen.session.streams_opened == opened


def test_publish_layout(coordinator, monkeypatch):
    monkeypatch.setenv("REFIT_COORDINATOR", coordinator.grpc_target)
    info = MemberInfo(job="job", role=Role.TRAINER, rank=1, world_size=2)
    with AgentSession.from_env(info, NullHandler()) as session:
        layout = row_layout(1, 2)
        digest = session.publish_layout(layout)
        assert digest == layout.digest
        assert session.publish_layout(layout) == digest  # unchanged: no call
        with pytest.raises(InvalidArgument) as err:
            session.publish_layout(row_layout(0, 2))
        assert "rank 1" in err.value.message
        member = coordinator.core.membership.find(session.member_id)
        assert member.layout_digest == digest
        member_id = session.member_id
    assert coordinator.core.membership.find(member_id) is None  # close() deregistered


def test_start_waits_for_a_late_coordinator_and_reconnects_streams(coordinator_factory, redis_url):
    port = free_port()
    info = MemberInfo(job="job", role=Role.TRAINER)
    session = AgentSession(f"127.0.0.1:{port}", info, NullHandler(), timeout_s=20)
    starter = threading.Thread(target=session.start)
    starter.start()
    time.sleep(0.5)  # nothing listens yet: start() keeps retrying
    first = coordinator_factory(redis_url, grpc_port=port)
    starter.join(20)
    assert session.member_id
    wait_until(lambda: first.core.outbox.connected(session.member_id), what="stream")

    first.stop(graceful=True)
    second = coordinator_factory(redis_url, grpc_port=port)
    # Same member (state came back from Redis), stream re-established to the new process.
    wait_until(
        lambda: second.core.outbox.connected(session.member_id), timeout_s=10, what="reconnect"
    )
    assert session.registrations == 1
    second.core.outbox.send(session.member_id, LeaveGroupCmd(epoch=7, abort=True))
    session.close()


def test_start_gives_up_when_nobody_answers():
    info = MemberInfo(job="job", role=Role.TRAINER)
    session = AgentSession(f"127.0.0.1:{free_port()}", info, NullHandler(), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(Unavailable):
        session.start()
    assert time.monotonic() - started < 5
    session.close(deregister=False)
