"""`SidecarMember`: the command handler of a replica controller, the one member that drives a
vLLM replica through every refit (pause, start the update, let the workers receive, wait for
the coordinator to say every rank verified, finish, resume, report the version). Success is
read from the coordinator, never from vLLM's status codes. The wait for the ranks is
`ranks_verified`'s, the engine verbs around the transfer `engine_steps`'."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from refitplane.agent.handler import NullHandler
from refitplane.agent.session import AgentSession
from refitplane.client.sync import RefitClient
from refitplane.errors import FailedPrecondition, RefitError, TransferError, Unavailable
from refitplane.protocol import Role
from refitplane.protocol.messages import (
    RANKS_VERIFIED_LABEL,
    AbortRefitCmd,
    LeaveGroupCmd,
    MemberInfo,
    PrepareRefitCmd,
    RanksVerifiedCmd,
    StartTransferCmd,
)
from refitplane.replica.background import BackgroundCaller
from refitplane.replica.control import (
    ENGINE_STATUS_TIMEOUT_S,
    EngineControl,
    StatusSink,
    succeeded,
)
from refitplane.replica.engine_steps import EngineSteps
from refitplane.replica.ranks_verified import RanksVerifiedWait
from refitplane.replica.state import SidecarState
from refitplane.replica.told import StreamNews

log = logging.getLogger("refitplane.sidecar")


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
        prearm_wait_s: float = 0.0,
        update_wait_s: float = 900.0,
    ) -> None:
        """`sleep_level`: the level the caller puts the engine to sleep with between
        refits (0: never); a refit wakes it (`EngineSteps.wake_weights`).
        `prearm_wait_s` > 0 pre-arms the update (docs/generator.md, "The update, pre-armed"):
        /update_weights goes to vLLM at PrepareRefit, on a thread of its own, and its workers
        wait up to that long for the coordinator's StartTransfer; only for an engine whose
        verbs may be called from two threads at once (vLLM's HTTP server). `update_wait_s`
        bounds the wait, from StartTransfer, for that call's answer."""
        self.control = control
        self.client = client
        self.job = job
        self.replica_id = replica_id
        self.default_pause_mode = default_pause_mode
        self.state = SidecarState()
        self.session: AgentSession | None = None
        self._lock = threading.Lock()
        # RanksVerified and AbortRefit, told at once by the stream thread to the waiting
        # StartTransfer (docs/generator.md, "Waiting for the ranks").
        self.told = StreamNews()
        # The replica's ranks, read at PrepareRefit, and the wait for them to verify.
        self.ranks = RanksVerifiedWait(
            client,
            self.told,
            job=job,
            replica_id=replica_id,
            verify_wait_s=verify_wait_s,
            session=lambda: self.session,
            fail=self._failed,
        )
        self.engine_steps = EngineSteps(
            control,
            self.state,
            sleep_level=sleep_level,
            metrics=metrics,
            ranks_epoch=lambda: self.ranks.epoch,
        )
        self.prearm_wait_s = prearm_wait_s
        self.update_wait_s = update_wait_s
        # The pre-armed update in flight: (refit id, its answer to come), and the thread
        # that makes it.
        self._prearmed: tuple[str, Future[int]] | None = None
        self._caller = BackgroundCaller("sidecar-prearmed-update")
        # The refit whose failure (here, after weights were written) named why the replica
        # is not ready: its AbortRefit does not replace that reason (`on_abort_refit`).
        self._failure_named = ""

    def attach(self, session: AgentSession) -> None:
        self.session = session

    @property
    def prearmed_refit(self) -> str:
        """The refit whose update was pre-armed and not yet taken up ("" if none)."""
        prearmed = self._prearmed
        return prearmed[0] if prearmed is not None else ""

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
        steps = _Steps()
        with self._lock:
            self.state.refit_id = cmd.refit_id
            self.state.weights_touched = False
        self.told.new_refit(cmd.refit_id)
        # Read now (once per group epoch: ranks only change with the group) so that nothing
        # but the update itself runs between StartTransfer and the ranks' transfer. Also
        # after this controller registered again (`RanksVerifiedWait.ranks_stale`).
        if self.ranks.ranks_stale(cmd.epoch):
            self.ranks.read_ranks(cmd.epoch)
        # Before Prepared: the coordinator sends RanksVerified only after it.
        self.ranks.mark_streams()
        steps.mark("ranks")
        status = self.control.pause(mode)
        if not succeeded(status):
            raise FailedPrecondition(
                f"vLLM refused to pause (mode {mode}, HTTP {status}) for refit {cmd.refit_id}; "
                "nothing was received. An offline engine pauses by clearing its prefix cache, "
                "which fails while it still generates: see the sidecar's log for vLLM's answer"
            )
        self.state.paused = True
        steps.mark("pause")
        if self.engine_steps.sleep_level:
            self.engine_steps.wake_weights(cmd.refit_id)
            steps.mark("wake")
        status = self.control.start_update()
        if not succeeded(status):
            # Nothing was started, so the abort that follows must not finish anything.
            raise FailedPrecondition(
                f"vLLM refused /start_weight_update (HTTP {status}) for refit {cmd.refit_id}; "
                "is another update in progress? See the vLLM log"
            )
        self.state.update_open = True
        steps.mark("start")
        if self.prearm_wait_s > 0:
            self._prearm(cmd)
            steps.mark("prearmed")
        assert self.session is not None
        self.session.report_prepared(cmd.refit_id)
        steps.mark("reported")
        # PREPARING waits for the slowest member: this line says which of vLLM's verbs it was.
        log.info("replica %s prepared refit %s: %s", self.replica_id, cmd.refit_id, steps)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        steps = _Steps()
        if self.state.refit_id != cmd.refit_id:  # no PrepareRefit seen in this process
            self.ranks.read_ranks(-1)
            self.ranks.mark_streams()
        self.state.weights_touched = self.ranks.touches_live or self.state.weights_lost
        prearmed, self._prearmed = self._prearmed, None
        if prearmed is not None and prearmed[0] == cmd.refit_id:
            self._await_prearmed(cmd.refit_id, prearmed[1])
        else:
            self.control.update({"refit_id": cmd.refit_id, "version": cmd.version})
        steps.mark("update")
        try:
            self.ranks.require_verified(
                cmd.refit_id, pushed=cmd.ranks_verified, touched=self.state.weights_touched
            )
            steps.mark("verified")
        except TransferError:
            self.engine_steps.close_update(cmd.refit_id)
            if not self.state.weights_touched:
                self.engine_steps.release()
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
            self.ranks.require_not_told_aborted(cmd.refit_id)
            # Before the report: once it commits, the caller may use the engine again.
            if self.engine_steps.export_staging():
                steps.mark("metrics")
            # The answer is the check that the refit did not fail meanwhile; the engine
            # resumes only after it (requests sent meanwhile wait in vLLM's pause queue).
            self._report_version(cmd.refit_id, cmd.version)
            steps.mark("reported")
            self._take_version(cmd.version)
            # The refit's outcome is decided (it commits with this replica at the version),
            # so a failed resume fails nothing: the replica holds the version, serves nothing
            # and says so (not ready, paused) until a later refit resumes it.
            why = self.engine_steps.after_finish("/resume", self.control.resume, cmd.refit_id)
            if why:
                self._degrade(why)
                return
            steps.mark("resume")
            self._resumed()
        log.info("replica %s serves version %d: %s", self.replica_id, cmd.version, steps)

    def close(self) -> None:
        """Ends the pre-arming thread (after a call in flight); the owner closes the rest."""
        self._caller.close()

    def _prearm(self, cmd: PrepareRefitCmd) -> None:
        """Send the refit's /update_weights now, on a thread of its own: vLLM's hop to its
        workers (API server, engine core, collective_rpc; ~3 ms) then overlaps the
        coordinator's wait for the other members' Prepared, and each worker begins
        receiving as soon as its own StartTransfer arrives (`WorkerMember.wait_for_start`)."""
        update_info = {
            "refit_id": cmd.refit_id,
            "version": cmd.version,
            "start_wait_s": self.prearm_wait_s,
        }
        self._prearmed = (
            cmd.refit_id,
            self._caller.submit(lambda: self.control.update(update_info)),
        )

    def _await_prearmed(self, refit_id: str, answer: Future[int]) -> None:
        """StartTransfer of a pre-armed refit: vLLM's answer to its /update_weights (the
        workers received, or failed); its status is not the outcome (the coordinator's is)."""
        try:
            answer.result(timeout=self.update_wait_s)
        except FutureTimeout:
            raise Unavailable(
                f"refit {refit_id}: vLLM did not answer the /update_weights pre-armed at "
                f"PrepareRefit within {self.update_wait_s:g} s of StartTransfer "
                "(REFIT_UPDATE_TIMEOUT_S); see the vLLM log"
            ) from None

    def _prearmed_touched(self, refit_id: str) -> bool:
        """An abort of a pre-armed refit whose StartTransfer this controller did not run:
        the workers may have begun (their own StartTransfer came) or not. Wait, bounded, for
        the update's answer (an abort ends the workers' wait at once), close the update, and
        read from the workers whether any received bytes reached their weights (their
        finish then says "incomplete"). Unreadable: assumed as for a started refit."""
        prearmed, self._prearmed = self._prearmed, None
        if prearmed is None or prearmed[0] != refit_id:
            return False
        try:
            prearmed[1].result(timeout=self.update_wait_s)
        except Exception:  # its failure is the refit's, already aborted
            log.debug("the pre-armed update of refit %s failed", refit_id, exc_info=True)
        self.engine_steps.close_update(refit_id)
        try:
            statuses = self.control.engine_status()
        except RefitError as exc:
            log.warning("refit %s: the workers' status after the abort: %s", refit_id, exc)
            statuses = None
        if statuses is None:
            return self.ranks.touches_live
        return any(s.get("incomplete") for s in statuses)

    def _wake_kv_cache_and_report(self, cmd: StartTransferCmd, steps: _Steps) -> None:
        """The end of a refit that woke the engine from sleep: the KV cache takes memory back
        only for a refit that has not failed (read first), and the engine runs again before
        the report, so a caller that puts it to sleep once the refit commits finds it
        resumed. Either failing fails the refit before the report: the replica never
        reports a version it does not serve."""
        self.ranks.require_not_failed(cmd.refit_id)
        steps.mark("checked")
        why = self.engine_steps.after_finish(
            "/wake_up?tags=kv_cache", lambda: self.control.wake_up(["kv_cache"]), cmd.refit_id
        )
        if not why:
            steps.mark("wake kv_cache")
            why = self.engine_steps.after_finish("/resume", self.control.resume, cmd.refit_id)
        if why:
            raise self._failed(
                f"{why}; the weights are in, but the engine cannot serve", touched=True
            )
        steps.mark("resume")
        self._take_version(cmd.version)
        self._resumed()
        if self.engine_steps.export_staging():
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
        """From the stream thread: wakes the StartTransfer waiting in
        `RanksVerifiedWait.require_verified`."""
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
        if self._prearmed is not None and self.state.update_open:
            touched = self._prearmed_touched(cmd.refit_id) or touched
        if self.state.update_open:  # else vLLM has no update of ours to close
            self.engine_steps.close_update(cmd.refit_id)
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
            self.engine_steps.release()

    # -- helpers -------------------------------------------------------------------------------

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
            refit = self.ranks.read_unended(refit_id, when=" while finishing", touched=True)
        except RefitError as exc:
            if isinstance(exc, TransferError):
                raise  # the refit ended: named by `RanksVerifiedWait.read_unended`
            why += f" ({exc.message})"
        else:
            why += f" (the refit is {refit.state.value})"
        raise self._failed(why, touched=True)

    def _failed(self, message: str, *, touched: bool) -> TransferError:
        """The refit's failure at this replica: not ready where `touched` (weights of the
        refit may be in the engine), with this refit named as the reason's."""
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
