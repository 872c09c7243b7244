"""`SidecarMember`: the command handler of a replica controller, the one member that drives a
vLLM replica through every refit (pause, start the update, let the workers receive, wait for
the coordinator to say every rank verified, finish, resume, report the version). Success is
read from the coordinator, never from vLLM's status codes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refitplane.agent.handler import NullHandler
from refitplane.agent.session import AgentSession
from refitplane.client.sync import RefitClient
from refitplane.errors import FailedPrecondition, RefitError, TransferError
from refitplane.protocol import RefitState, Role
from refitplane.protocol.messages import (
    RANKS_VERIFIED_LABEL,
    AbortRefitCmd,
    LeaveGroupCmd,
    MemberInfo,
    PrepareRefitCmd,
    RanksVerifiedCmd,
    StartTransferCmd,
)
from refitplane.protocol.models import Refit
from refitplane.replica.control import (
    ENGINE_STATUS_TIMEOUT_S,
    EngineControl,
    StatusSink,
    succeeded,
    touches_live_weights,
)
from refitplane.replica.told import StreamNews

log = logging.getLogger("refitplane.sidecar")

# How often a wait for RanksVerified looks whether the command stream it would come on broke.
_STREAM_LOOK_S = 0.1
_ENDED = {RefitState.FAILED, RefitState.CANCELLED}


@dataclass
class SidecarState:
    version: int = 0
    paused: bool = False
    degraded: bool = False
    refit_id: str = ""
    # This sidecar started a weight update in vLLM that it has not finished yet.
    update_open: bool = False
    # The engine may have written live weights of the current refit.
    weights_touched: bool = False
    # The engine was asleep when the refit began, and this sidecar woke its weights.
    woke: bool = False
    # They were woken from sleep level 2: they do not hold the version the replica served,
    # so from then on the replica counts as modified until a refit commits.
    weights_lost: bool = False
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Steps:
    """Milliseconds per step of one update, for the log line an operator reads."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._steps: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self._steps.append((step, 1e3 * (now - self._last)))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {ms:.1f} ms" for step, ms in self._steps)


class SidecarMember(NullHandler):
    """The replica controller's command handler."""

    def __init__(
        self,
        control: EngineControl,
        client: RefitClient,
        *,
        job: str,
        replica_id: str,
        default_pause_mode: str,
        verify_wait_s: float = 30.0,
        metrics: StatusSink | None = None,
        sleep_level: int = 0,
    ) -> None:
        """`sleep_level`: the level the caller puts the engine to sleep with between
        refits (0: never); a refit wakes it (see `_wake_weights`)."""
        self.control = control
        self.client = client
        self.job = job
        self.replica_id = replica_id
        self.default_pause_mode = default_pause_mode
        self.verify_wait_s = verify_wait_s
        self.state = SidecarState()
        self.session: AgentSession | None = None
        self._lock = threading.Lock()
        # Read from the topology at PrepareRefit (`_read_ranks`), for group epoch
        # `_ranks_epoch`.
        self._rank_ids: set[str] = set()
        self._touches_live = False
        self._ranks_epoch: tuple[int, int] = (-1, 0)
        self.metrics = metrics
        # The ranks' epoch whose staging gauge cannot change: every worker's status said it
        # stages nothing (`_export_staging`).
        self._gauge_fixed_epoch: tuple[int, int] | None = None
        self.sleep_level = sleep_level
        # RanksVerified and AbortRefit, told at once by the stream thread to the waiting
        # StartTransfer (docs/generator.md, "Waiting for the ranks").
        self.told = StreamNews()
        # The session's (registrations, command streams opened) when this refit's PrepareRefit
        # was handled: a RanksVerified is lost only with the stream or registration it went to.
        self._stream_mark: tuple[int, int] = (0, 0)
        # The refit whose failure (here, after weights were written) named why the replica
        # is not ready: its AbortRefit does not replace that reason (`on_abort_refit`).
        self._failure_named = ""

    def attach(self, session: AgentSession) -> None:
        self.session = session

    def connect(
        self,
        coordinator: str,
        *,
        host: str,
        token: str | None,
        tls_ca: str | None,
        labels: dict[str, str] | None = None,
    ) -> AgentSession:
        """The session this controller registers with (role GENERATOR_SIDECAR, rank 0 of its
        replica), attached; the caller starts it."""
        info = MemberInfo(
            job=self.job,
            role=Role.GENERATOR_SIDECAR,
            rank=0,
            world_size=1,
            replica_id=self.replica_id,
            host=host,
            device="",
            # This controller waits for RanksVerified: the coordinator may send it.
            labels={**(labels or {}), RANKS_VERIFIED_LABEL: "push"},
        )
        session = AgentSession(
            coordinator,
            info,
            self,
            token=token,
            tls_ca=tls_ca,
            timeout_s=30.0,
            held_version=lambda: self.state.version,
        )
        self.attach(session)
        return session

    def seed_from_engines(self) -> None:
        """Start from what the engine's workers hold (a sidecar restarted next to a running
        vLLM): the lowest version they report, and not ready if one holds incomplete
        weights. Before registering, so the registration carries that version."""
        statuses = self.control.engine_status()
        if not statuses:
            return
        versions = [s.get("version") for s in statuses]
        if all(isinstance(v, int) for v in versions):
            self.state.version = min(v for v in versions if isinstance(v, int))
        if any(s.get("incomplete") for s in statuses):
            self._degrade("a worker holds incomplete weights (an update failed after writing)")

    def engines_hold_version(self, timeout_s: float = ENGINE_STATUS_TIMEOUT_S) -> bool:
        """Whether vLLM's workers still hold this replica's version (asked at every readiness
        check): False once one holds weights no refit produced (vLLM's sleep at level 2
        discarded them, whoever asked) or a lower version; this controller's version then
        drops to what they hold. True when they cannot be asked (no dev-mode
        /collective_rpc) or an update of ours is open; Unavailable when they do not answer
        within `timeout_s`."""
        version = self.state.version
        statuses = self.control.engine_status(timeout_s=timeout_s)
        if not statuses:
            return True
        versions = [s.get("version") for s in statuses]
        if not all(isinstance(v, int) for v in versions):
            return True
        held = min(v for v in versions if isinstance(v, int))
        lost = any(s.get("incomplete") for s in statuses)
        with self._lock:
            if self.state.update_open or self.state.version != version:
                return True  # a refit moved on meanwhile: these statuses may be stale
            if held < version:
                log.warning(
                    "replica %s: its workers hold version %d, not %d (weights discarded?)",
                    self.replica_id,
                    held,
                    self.state.version,
                )
                self.state.version = held
            return not lost

    # -- commands -----------------------------------------------------------------------------

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        mode = cmd.pause_mode or self.default_pause_mode
        with self._lock:
            self.state.refit_id = cmd.refit_id
            self.state.weights_touched = False
        self.told.new_refit(cmd.refit_id)
        # Read now (once per group epoch: ranks only change with the group) so that nothing
        # but the update itself runs between StartTransfer and the ranks' transfer. Also
        # after this controller registered again: a coordinator that restarted on an empty
        # store numbers epochs from 1 again, with every rank under a new member id.
        if self._ranks_epoch != self._epoch_key(cmd.epoch) or not self._rank_ids:
            self._read_ranks(cmd.epoch)
        # Before Prepared: the coordinator sends RanksVerified only after it.
        self._stream_mark = self._session_mark()
        status = self.control.pause(mode)
        if not succeeded(status):
            raise FailedPrecondition(
                f"vLLM refused to pause (mode {mode}, HTTP {status}) for refit {cmd.refit_id}"
            )
        self.state.paused = True
        if self.sleep_level:
            self._wake_weights(cmd.refit_id)
        status = self.control.start_update()
        if not succeeded(status):
            # Nothing was started, so the abort that follows must not finish anything.
            raise FailedPrecondition(
                f"vLLM refused /start_weight_update (HTTP {status}) for refit {cmd.refit_id}; "
                "is another update in progress? See the vLLM log"
            )
        self.state.update_open = True
        assert self.session is not None
        self.session.report_prepared(cmd.refit_id)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        steps = _Steps()
        if self.state.refit_id != cmd.refit_id:  # no PrepareRefit seen in this process
            self._read_ranks(-1)
            self._stream_mark = self._session_mark()
        self.state.weights_touched = self._touches_live or self.state.weights_lost
        self.control.update({"refit_id": cmd.refit_id, "version": cmd.version})
        steps.mark("update")
        try:
            self._require_ranks_verified(cmd.refit_id, pushed=cmd.ranks_verified)
            steps.mark("verified")
        except TransferError:
            self._close_update(cmd.refit_id)
            if not self.state.weights_touched:
                self._release()
            raise
        self.state.weights_touched = True  # finish applies staged weights, or post-processes
        status = self.control.finish(cmd.version)
        self.state.update_open = False
        if not succeeded(status):
            # vLLM did not take the version (its reload failed, or a rank did not apply).
            raise self._failed(
                f"vLLM answered HTTP {status} to /finish_weight_update of refit {cmd.refit_id}; "
                "see the vLLM log",
                touched=True,
            )
        steps.mark("finish")
        if self.state.woke:
            self._wake_kv_cache_and_report(cmd, steps)
        else:
            self._require_not_told_aborted(cmd.refit_id)
            # Before the report: once it commits, the caller may use the engine again.
            if self._export_staging():
                steps.mark("metrics")
            # The answer is the check that the refit did not fail meanwhile; the engine
            # resumes only after it (requests sent meanwhile wait in vLLM's pause queue).
            self._report_version(cmd.refit_id, cmd.version)
            steps.mark("reported")
            self._take_version(cmd.version)
            # The refit's outcome is decided (it commits with this replica at the version),
            # so a failed resume fails nothing: the replica holds the version, serves nothing
            # and says so (not ready, paused) until a later refit resumes it.
            why = self._after_finish("/resume", self.control.resume, cmd.refit_id)
            if why:
                self._degrade(why)
                return
            steps.mark("resume")
            self._resumed()
        log.info("replica %s serves version %d: %s", self.replica_id, cmd.version, steps)

    def _after_finish(self, verb: str, call: Callable[[], int], refit_id: str) -> str:
        """Run `call`, an engine verb after vLLM's finish (waking the KV cache, resuming):
        empty when it succeeded, else why the engine cannot serve, naming `verb` and vLLM's
        answer. Either way a failure leaves the replica not ready; whether it also fails
        the refit depends on whether the report went first (`on_start_transfer`)."""
        try:
            status = call()
        except RefitError as exc:
            return f"vLLM did not answer {verb} after refit {refit_id}: {exc.message}"
        if succeeded(status):
            return ""
        return f"vLLM answered HTTP {status} to {verb} after refit {refit_id}"

    def _wake_kv_cache_and_report(self, cmd: StartTransferCmd, steps: _Steps) -> None:
        """The end of a refit that woke the engine from sleep: the KV cache takes memory back
        only for a refit that has not failed (read first), and the engine runs again before
        the report, so a caller that puts it to sleep once the refit commits finds it
        resumed. Either failing fails the refit before the report: the replica never
        reports a version it does not serve."""
        self._require_not_failed(cmd.refit_id)
        steps.mark("checked")
        why = self._after_finish(
            "/wake_up?tags=kv_cache", lambda: self.control.wake_up(["kv_cache"]), cmd.refit_id
        )
        if not why:
            steps.mark("wake kv_cache")
            why = self._after_finish("/resume", self.control.resume, cmd.refit_id)
        if why:
            raise self._failed(
                f"{why}; the weights are in, but the engine cannot serve", touched=True
            )
        steps.mark("resume")
        self._take_version(cmd.version)
        self._resumed()
        if self._export_staging():
            steps.mark("metrics")
        assert self.session is not None
        self.session.report_replica_updated(cmd.refit_id, cmd.version)
        steps.mark("reported")

    def _take_version(self, version: int) -> None:
        with self._lock:
            self.state.degraded = False
            self.state.version = version
            self.state.last_error = ""

    def _resumed(self) -> None:
        with self._lock:
            self.state.woke = self.state.weights_lost = False
            self.state.paused = False

    def on_ranks_verified(self, cmd: RanksVerifiedCmd) -> None:
        """From the stream thread: wakes the StartTransfer waiting in `_require_ranks_verified`."""
        self.told.ranks_verified(cmd)

    def on_abort_now(self, cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        """From the stream thread: a StartTransfer waiting for its ranks fails at once (the
        cleanup is `on_abort_refit`'s, in order, after it)."""
        if isinstance(cmd, AbortRefitCmd):
            self.told.aborted(cmd)

    def on_abort_refit(self, cmd: AbortRefitCmd) -> None:
        with self._lock:
            if cmd.refit_id and cmd.refit_id != self.state.refit_id:
                return
            touched = self.state.weights_touched or self.state.weights_lost
        if self.state.update_open:  # else vLLM has no update of ours to close
            self._close_update(cmd.refit_id)
        if not self.state.paused:
            return
        if touched:
            # This controller's own failure of the refit, if it came first, named what
            # failed (a verb after finish, a rank that did not verify): it stays the reason.
            if self._failure_named != self.state.refit_id:
                self._degrade(
                    f"refit {cmd.refit_id} aborted ({cmd.reason}) after weights were written"
                )
        elif self.state.degraded:
            log.warning(
                "replica %s stays paused: it still holds the weights of an earlier failed refit",
                self.replica_id,
            )
        else:
            self._release()

    # -- helpers -------------------------------------------------------------------------------

    def _wake_weights(self, refit_id: str) -> None:
        """An engine asleep at the refit's start (the caller put it to sleep while the
        trainer stepped) gets its weights back before any byte moves: the workers receive
        into the parameters' memory, which sleep unmapped. The KV cache stays asleep until
        the new weights verified (`on_start_transfer`)."""
        self.state.woke = self.state.weights_lost = False
        if not self.control.is_sleeping():
            return
        status = self.control.wake_up(["weights"])
        # Level 2 dropped the weights: whatever woke holds no version, even if this failed.
        self.state.weights_lost = self.sleep_level >= 2
        if not succeeded(status):
            raise FailedPrecondition(
                f"vLLM answered HTTP {status} to /wake_up?tags=weights for refit {refit_id}: "
                "the weights cannot be received while asleep (is the trainer holding the "
                "memory they need?)"
            )
        self.state.woke = True

    def _release(self) -> None:
        """A refit that failed before any byte landed: leave the engine as it was found —
        asleep again if it was asleep (level 1: its weights go back to host memory, intact),
        else resumed."""
        if self.state.woke:
            self.control.sleep(self.sleep_level)
            self.state.woke = False
        else:
            self.control.resume()
        self.state.paused = False

    def _close_update(self, refit_id: str) -> None:
        """vLLM needs every started update finished: drop what was staged first, so this
        finish applies nothing of a refit that failed somewhere in the replica (and names no
        version: the replica keeps the one it fully holds)."""
        self.control.update({"refit_id": refit_id, "action": "discard"})
        self.control.finish(None)
        self._export_staging()
        # Last: once the update reads closed, this sidecar makes no more vLLM calls for it.
        self.state.update_open = False

    def _export_staging(self) -> bool:
        """Refresh the staging gauge after a refit (never fails one: metrics only); whether
        the engines were asked. Workers that stage nothing (live receive without fallback
        layers) report 0 for as long as they are registered: once their statuses said so,
        later refits of the same ranks skip this round trip through vLLM (~1 ms between the
        last byte and COMMITTED, measured on vLLM 0.26)."""
        if self.metrics is None or self._gauge_fixed_epoch == self._ranks_epoch:
            return False
        try:
            statuses = self.control.engine_status()
        except Exception:  # a metric must not fail a refit
            log.debug("reading the engines' status for metrics failed", exc_info=True)
            return True
        if statuses:
            self.metrics.update(statuses)
            # `stages` absent (an older worker): assume it does, ask every time.
            if not any(s.get("stages", True) for s in statuses):
                self._gauge_fixed_epoch = self._ranks_epoch
        return True

    def _replica_ranks(self) -> list[Any]:
        topo = self.client.topology(self.job)
        return [
            m for m in topo.members if m.role == Role.GENERATOR and m.replica_id == self.replica_id
        ]

    def _read_ranks(self, epoch: int) -> None:
        """The replica's rank member ids, and whether they receive into live parameters."""
        ranks = self._replica_ranks()
        self._rank_ids = {m.member_id for m in ranks}
        self._touches_live = touches_live_weights([m.labels.get("receive_mode", "") for m in ranks])
        self._ranks_epoch = self._epoch_key(epoch)

    def _epoch_key(self, epoch: int) -> tuple[int, int]:
        """What the ranks read are valid for: the group epoch, under this registration."""
        return epoch, self.session.registrations if self.session is not None else 0

    def _session_mark(self) -> tuple[int, int]:
        s = self.session
        return (s.registrations, s.streams_opened) if s is not None else (0, 0)

    def _require_ranks_verified(self, refit_id: str, *, pushed: bool) -> None:
        """Wait until the coordinator says every rank of the replica verified (RanksVerified,
        pushed when it accepts the last rank's verified TransferDone), or the refit failed
        (AbortRefit, which follows any RanksVerified of the refit on the same stream), for up
        to `verify_wait_s`. The push is lost only with the stream it was written to, or with
        this member's registration (a coordinator that lost its store, a lapsed lease): once
        either moved since PrepareRefit, and at the deadline, the record is read instead
        (`_read_ranks_verified`), so a restarted coordinator or a lost store shows as the
        refit's end or as an error, never as success. Not `pushed` (a coordinator that does
        not send RanksVerified): the record is read until the ranks verified, backing off
        from 2 ms."""
        deadline = time.monotonic() + self.verify_wait_s
        delay = 0.002
        while True:
            self.told.clear()
            verified, abort = self.told.of(refit_id)
            if abort is not None:
                raise self._failed(
                    f"refit aborted: {abort.reason} {abort.message}",
                    touched=self.state.weights_touched,
                )
            if verified is not None:
                if self._rank_ids and self._rank_ids <= verified.member_ids:
                    return
                # The coordinator's ranks of this replica are not the ones read at
                # PrepareRefit: the record says which of ours verified.
                self._read_ranks_verified(refit_id, last=True)
                return
            mark = self._session_mark()
            if mark != self._stream_mark or not pushed:
                self._stream_mark = mark
                if self._read_ranks_verified(refit_id, last=False):
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._read_ranks_verified(refit_id, last=True)
                return
            self.told.wait(min(remaining, _STREAM_LOOK_S if pushed else delay))
            delay = min(2 * delay, 0.05)

    def _read_ranks_verified(self, refit_id: str, *, last: bool) -> bool:
        """One GetRefit: whether every rank of the replica verified. Raises when the refit
        ended, and (`last`) when a rank did not verify, naming it."""
        ranks = self._rank_ids
        refit = self._read_unended(refit_id, when="", touched=self.state.weights_touched)
        done = {r.member_id for r in refit.ranks if r.member_id in ranks and r.fully_verified}
        if ranks and done == ranks:
            return True
        if last:
            missing = sorted(ranks - done)
            raise self._failed(
                f"ranks {missing} of replica {self.replica_id} did not verify the transfer",
                touched=self.state.weights_touched,
            )
        return False

    def _require_not_told_aborted(self, refit_id: str) -> None:
        """After vLLM's finish: an AbortRefit of the refit already on the stream fails it
        without asking anyone."""
        _, abort = self.told.of(refit_id)
        if abort is not None:
            raise self._failed(
                f"refit aborted while finishing: {abort.reason} {abort.message}", touched=True
            )

    def _require_not_failed(self, refit_id: str) -> None:
        """After vLLM's finish, before the KV cache wakes: the refit did not fail meanwhile.
        An AbortRefit already here says so without asking; otherwise the record is read,
        because the AbortRefit that the coordinator queues before it shows the failure may
        still be on its way (docs/generator.md, "Waiting for the ranks")."""
        self._require_not_told_aborted(refit_id)
        self._read_unended(refit_id, when=" while finishing", touched=True)

    def _read_unended(self, refit_id: str, *, when: str, touched: bool) -> Refit:
        """One GetRefit: the refit, unless it ended (FAILED or CANCELLED): then this
        replica's failure, naming the state, `when` it was read, the reason and the
        coordinator's message."""
        refit: Refit = self.client.get(refit_id)
        if refit.state in _ENDED:
            raise self._failed(
                f"refit {refit.state.value}{when}: {refit.reason} {refit.message}",
                touched=touched,
            )
        return refit

    def _report_version(self, refit_id: str, version: int) -> None:
        """Report ReplicaUpdated; the replica takes the version only if the coordinator
        accepted it. The coordinator accepts a report only while the refit is current and
        has not failed (a failure is set in its memory before AbortRefit is queued and
        before FAILED is written), so the answer says what a read of the record after
        vLLM's finish said, one round trip sooner and no later than the commit it causes
        (docs/generator.md, "Waiting for the ranks"). Not accepted: the replica stays
        paused and not ready, and one read names why."""
        assert self.session is not None
        if self.session.report_replica_updated(refit_id, version):
            return
        why = "the coordinator did not accept its ReplicaUpdated"
        try:
            refit = self._read_unended(refit_id, when=" while finishing", touched=True)
        except RefitError as exc:
            if isinstance(exc, TransferError):
                raise  # the refit ended: named by `_read_unended`
            why += f" ({exc.message})"
        else:
            why += f" (the refit is {refit.state.value})"
        raise self._failed(why, touched=True)

    def _failed(self, message: str, *, touched: bool) -> TransferError:
        if touched:
            self._degrade(message)
            self._failure_named = self.state.refit_id
        exc = TransferError(message)
        exc.weights_modified = touched  # type: ignore[attr-defined]
        return exc

    def _degrade(self, message: str) -> None:
        log.error("replica %s not ready: %s", self.replica_id, message)
        with self._lock:
            self.state.degraded = True
            self.state.last_error = message
