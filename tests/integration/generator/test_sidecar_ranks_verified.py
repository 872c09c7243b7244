"""The replica controller waits for the coordinator's RanksVerified push instead of reading
the refit record (issue 23), against a real coordinator on Redis with simulated ranks (real
agent sessions, no data plane): the push arrives once every rank of the replica verified and
the refit commits without a read (the report's answer is the check after finish); a push the coordinator never
delivers falls back to one read at the controller's deadline, or at once when the command
stream it went to broke; a coordinator that does not push (older) is polled as before, and
a sidecar without the label that asks for the push (older) is not sent it; a refit that fails elsewhere while the controller waits, or while
vLLM finishes, never lets the replica take the version. Faults are injected into the
running coordinator's outbox (commands dropped as a broken stream loses them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.client import RefitClient
from refitplane.protocol import RefitState, Role
from refitplane.protocol.messages import (
    AbortRefitCmd,
    CommandBody,
    RanksVerifiedCmd,
    StartTransferCmd,
)
from refitplane.protocol.models import Refit
from refitplane.replica.control import CallerPausedControl
from refitplane.replica.controller import SidecarMember
from tests.integration.conftest import row_layout, wait_until
from tests.support.controllers import start_controller

pytestmark = pytest.mark.integration


class _Engine(CallerPausedControl):
    """An engine whose every verb succeeds; `calls` records them, `on_finish` runs inside
    `finish` (what happens elsewhere while vLLM applies the update)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.on_finish: Callable[[], None] | None = None
        self.resume_status = 200

    def _ok(self, call: str) -> int:
        self.calls.append(call)
        return 200

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return 200

    def pause(self, mode: str) -> int:
        return self._ok("pause")

    def resume(self) -> int:
        self._ok("resume")
        return self.resume_status

    def start_update(self) -> int:
        return self._ok("start_update")

    def update(self, update_info: dict[str, Any]) -> int:
        return self._ok(str(update_info.get("action", "update")))

    def finish(self, version: int | None) -> int:
        if version is not None and self.on_finish is not None:
            self.on_finish()
        return self._ok(f"finish {version}")

    def engine_status(self, timeout_s: float = 30.0) -> list[dict[str, Any]] | None:
        return None


class _CountingClient(RefitClient):
    """A real client that counts the controller's record reads (GetRefit)."""

    reads = 0

    def get(self, refit_id: str) -> Refit:
        self.reads += 1
        return super().get(refit_id)


def _drop(
    coordinator: Any,
    kind: type,
    then: Callable[[], None] | None = None,
    rewrite: Callable[[CommandBody], CommandBody] = lambda body: body,
) -> list[Any]:
    """From now on the coordinator's outbox drops commands of `kind` (`then` runs after
    each) and sends the others through `rewrite`; returns the (member id, command) dropped."""
    outbox = coordinator.core.outbox
    send = outbox.send
    dropped: list[tuple[str, CommandBody]] = []

    def send_or_drop(member_id: str, body: CommandBody) -> None:
        if not isinstance(body, kind):
            send(member_id, rewrite(body))
            return
        dropped.append((member_id, body))
        if then is not None:
            then()

    outbox.send = send_or_drop
    return dropped


@pytest.fixture
def replica(coordinator_factory, redis_url, sim_cluster):
    """`replica(verify_wait_s=..., ranks=Behaviour, other=Behaviour | None)`: a trainer rank
    and replica "a" (two generator ranks) simulated, its controller real over `_Engine`;
    `other`: a second replica "b" (one simulated rank, no controller). Returns (coordinator,
    cluster, ranks of "a", engine, member, the member's client)."""
    opened: list[Any] = []

    def make(
        verify_wait_s: float = 60.0, ranks: Behaviour | None = None, other: Behaviour | None = None
    ) -> tuple[Any, Any, list[Any], _Engine, SidecarMember, _CountingClient]:
        coordinator = coordinator_factory(redis_url)
        cluster = sim_cluster(coordinator)
        cluster.add(Role.TRAINER, layout=row_layout(0, 1))
        rank_members = cluster.replica("a", world=2, behaviour=ranks)
        if other is not None:
            cluster.add(Role.GENERATOR, replica="b", layout=row_layout(0, 1), behaviour=other)
        engine = _Engine()
        client = _CountingClient(coordinator.grpc_target)
        member, session = start_controller(
            coordinator.grpc_target, engine, client, verify_wait_s=verify_wait_s
        )
        opened.append((session, client))
        return coordinator, cluster, rank_members, engine, member, client

    yield make
    for session, client in opened:
        session.close()
        client.close()


def _refit(cluster: Any) -> Refit:
    with cluster.client() as client:
        return client.wait(client.trigger("job").refit_id, timeout_s=30)


def test_the_push_arrives_and_the_refit_commits(replica):
    _, cluster, ranks, engine, member, client = replica()
    refit = _refit(cluster)
    assert refit.state is RefitState.COMMITTED, refit.message
    told, _ = member.told.of(refit.refit_id)
    assert told is not None
    assert (told.refit_id, told.version) == (refit.refit_id, refit.version)
    assert told.member_ids == {r.member_id for r in ranks}
    assert member.session is not None
    assert member.session.info.labels["ranks_verified"] == "push"
    # No read while waiting, none after finish: the accepted report was the check.
    assert client.reads == 0
    # The engine resumes once the coordinator accepted the report (that committed the refit).
    wait_until(lambda: not member.state.paused, what="the engine resumed")
    assert engine.calls == ["pause", "start_update", "update", f"finish {refit.version}", "resume"]
    assert member.state.version == refit.version
    assert not member.state.degraded


def test_a_lost_push_falls_back_to_one_read_at_the_deadline(replica):
    coordinator, cluster, _, _, member, client = replica(verify_wait_s=1.0)
    dropped = _drop(coordinator, RanksVerifiedCmd)
    refit = _refit(cluster)
    assert refit.state is RefitState.COMMITTED, refit.message
    assert [(mid, cmd.refit_id) for mid, cmd in dropped] == [
        (member.session.member_id, refit.refit_id)
    ]
    assert member.told.of(refit.refit_id) == (None, None)
    assert client.reads == 1  # the fallback read; the report checks after finish
    assert member.state.version == refit.version


def test_a_push_lost_with_its_stream_is_read_once_the_stream_is_back(replica):
    """The controller's deadline (60 s) is past the coordinator's VERIFYING timeout (5 s):
    the refit commits only because the controller reads as soon as its stream reconnects."""
    coordinator, cluster, _, _, member, client = replica(verify_wait_s=60.0)
    session = member.session
    assert session is not None
    # The stream breaks just as the coordinator writes the push to it.
    _drop(coordinator, RanksVerifiedCmd, then=session._cancel_stream)
    opened = session.streams_opened
    refit = _refit(cluster)
    assert refit.state is RefitState.COMMITTED, refit.message
    assert session.streams_opened > opened
    assert client.reads == 1
    assert member.state.version == refit.version


def test_a_coordinator_that_does_not_push_is_polled(replica):
    """A coordinator from before RanksVerified: its StartTransfer does not announce the push
    and none comes. The controller reads the refit until the ranks verified (as it did
    before the push), well within the coordinator's VERIFYING timeout (5 s), not at its own
    deadline (60 s)."""
    coordinator, cluster, _, _, member, client = replica(verify_wait_s=60.0)

    def as_before(body: CommandBody) -> CommandBody:
        if isinstance(body, StartTransferCmd):
            return dataclasses.replace(body, ranks_verified=False)
        return body

    _drop(coordinator, RanksVerifiedCmd, rewrite=as_before)
    refit = _refit(cluster)
    assert refit.state is RefitState.COMMITTED, refit.message
    assert client.reads >= 1  # at least one poll; the report checks after finish
    assert member.state.version == refit.version


def test_a_sidecar_that_does_not_wait_for_the_push_is_not_sent_it(coordinator, sim_cluster):
    """A sidecar registered without the RanksVerified label (one from before the command,
    which could not decode it): no RanksVerified is queued for it and its StartTransfer says
    none will come; the refit commits as before."""
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    sidecar = cluster.replica("a", sidecar=True)[-1]
    sent = _drop(coordinator, RanksVerifiedCmd)
    refit = _refit(cluster)
    assert refit.state is RefitState.COMMITTED, refit.message
    assert sent == []
    assert [c.ranks_verified for c in sidecar.agent.received(StartTransferCmd)] == [False]


def test_a_refit_failing_at_another_replica_while_this_one_waits(replica):
    """Replica "a"'s ranks hold their transfer; "b" fails: the AbortRefit wakes the waiting
    controller at once (its deadline is 60 s), which closes vLLM's update without a version
    and keeps the replica paused and not ready (its ranks may have written live weights)."""
    _, cluster, _, engine, member, client = replica(
        ranks=Behaviour(hold_transfer_s=20.0),
        other=Behaviour(fail={"start_transfer": ("PEER_FAILED", "b lost its peer", True)}),
    )
    refit = _refit(cluster)
    assert refit.state is RefitState.FAILED, refit.message
    assert refit.reason == "PEER_FAILED"
    wait_until(lambda: "finish None" in engine.calls, what="vLLM's update closed")
    assert member.state.degraded
    assert member.state.paused
    assert engine.calls == ["pause", "start_update", "update", "discard", "finish None"]
    assert member.state.version == 0
    assert client.reads == 0  # the abort said it: nothing read


def test_a_refit_failing_at_another_replica_with_its_abort_lost_is_read_at_the_deadline(replica):
    """As above, but the AbortRefit is lost: at its deadline (2 s) the controller reads the
    record, which says FAILED, and fails naming the state, the reason and the coordinator's
    message; the replica stays paused and not ready."""
    coordinator, cluster, _, engine, member, client = replica(
        verify_wait_s=2.0,
        ranks=Behaviour(hold_transfer_s=3.0),
        other=Behaviour(fail={"start_transfer": ("PEER_FAILED", "b lost its peer", True)}),
    )
    _drop(coordinator, AbortRefitCmd)
    refit = _refit(cluster)
    assert refit.state is RefitState.FAILED, refit.message
    wait_until(lambda: "finish None" in engine.calls, what="vLLM's update closed")
    assert member.state.degraded
    assert member.state.paused
    assert engine.calls == ["pause", "start_update", "update", "discard", "finish None"]
    assert client.reads == 1
    error = member.state.last_error
    assert error.startswith("refit FAILED: PEER_FAILED "), error
    assert "b lost its peer" in error, error


@pytest.mark.parametrize("abort", ["delivered", "lost"])
def test_a_refit_cancelled_while_vllm_finishes_is_not_taken(replica, abort):
    """The ranks verified and vLLM finishes when the refit is cancelled. With the AbortRefit
    already at the controller it fails without reporting; with the AbortRefit lost, the
    coordinator refuses the report (the refit failed) and one read names CANCELLED. Either
    way the replica does not take the version, is not resumed, and is not ready (finish
    applied the weights)."""
    coordinator, cluster, _, engine, member, client = replica()
    if abort == "lost":
        _drop(coordinator, AbortRefitCmd)

    def cancel_meanwhile() -> None:
        with cluster.client() as other:
            refit_id = member.state.refit_id
            assert other.cancel(refit_id).state is RefitState.CANCELLED
        if abort == "delivered":
            wait_until(lambda: member.told.of(refit_id)[1] is not None, what="AbortRefit")

    engine.on_finish = cancel_meanwhile
    refit = _refit(cluster)
    assert refit.state is RefitState.CANCELLED, refit.message
    wait_until(lambda: member.state.degraded, what="the replica not ready")
    assert "resume" not in engine.calls
    assert member.state.version == 0
    assert member.state.paused
    assert client.reads == (1 if abort == "lost" else 0)
    # The first failure's reason stays: the AbortRefit handled after it says less.
    error = member.state.last_error
    if abort == "lost":
        assert f"refit CANCELLED while finishing: {refit.reason} " in error, error
    else:
        assert f"refit aborted while finishing: {refit.reason} " in error, error


def test_a_refit_that_times_out_refuses_reports_before_it_aborts(
    coordinator_factory, redis_url, sim_cluster
):
    """A failure raised rather than signalled (the TRANSFERRING timeout here) refuses reports
    from the moment the coordinator decides it, before any AbortRefit is queued and before
    FAILED is written: an accepted ReplicaUpdated (what lets a controller take the version)
    always means the refit had not failed."""
    coordinator = coordinator_factory(redis_url, transfer_timeout_s=1.0)
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    cluster.replica("a", behaviour=Behaviour(silent=frozenset({"start_transfer"})))
    refused_at_abort: list[bool] = []

    def look() -> None:
        run = coordinator.core._drivers["job"].current
        refused_at_abort.append(run is not None and run.failure is not None)

    _drop(coordinator, AbortRefitCmd, then=look)
    refit = _refit(cluster)
    assert refit.state is RefitState.FAILED, refit.message
    assert refit.reason == "TIMEOUT"
    assert refused_at_abort  # AbortRefit went out (to every participant)
    assert all(refused_at_abort)


def test_an_engine_that_does_not_resume_after_the_commit_is_not_ready(replica):
    """The engine resumes after the coordinator took the report, so a refit can show
    COMMITTED while vLLM refuses /resume: the replica holds the version but serves nothing,
    and says so (not ready, naming /resume) instead of looking healthy."""
    _, cluster, _, engine, member, _ = replica()
    engine.resume_status = 503
    refit = _refit(cluster)
    assert refit.state is RefitState.COMMITTED, refit.message
    wait_until(lambda: member.state.degraded, what="the replica not ready")
    assert "HTTP 503 to /resume" in member.state.last_error
    assert member.state.paused
    assert member.state.version == refit.version
