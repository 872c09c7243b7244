"""The refit state machine of one job: PENDING → PREPARING → TRANSFERRING → VERIFYING →
COMMITTED, or FAILED / CANCELLED with a reason. One driver task per job runs one refit at a
time; it is the only writer of the refit it drives (cancel and reports only signal it).

The machines it drives own their own state: group epochs (`groups`, formed on demand by the
refit that needs one), rank plans on their way out (`plan_delivery`), delta bases and the
delta choice (`delta`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from refitplane.coordinator.core.cast import Cast
from refitplane.coordinator.core.context import DriverContext
from refitplane.coordinator.core.delta import DeltaBases
from refitplane.coordinator.core.endings import RefitEndings
from refitplane.coordinator.core.failures import RefitFailed, list_some
from refitplane.coordinator.core.groups import GroupEpochs, is_group_report
from refitplane.coordinator.core.held_versions import HeldVersions
from refitplane.coordinator.core.layout_wait import await_layouts
from refitplane.coordinator.core.membership import Departure
from refitplane.coordinator.core.plan_delivery import PlanDelivery
from refitplane.coordinator.core.planning import PlannedRefit, Roster
from refitplane.coordinator.core.records import MemberRecord, RefitRecord
from refitplane.coordinator.core.replicas import ReplicaHealth
from refitplane.coordinator.core.report_check import transfer_done_mismatch
from refitplane.coordinator.core.run import RefitRun, phase_seconds
from refitplane.coordinator.core.topology import DriverView
from refitplane.coordinator.core.waits import cancel_and_wait, wait_event
from refitplane.coordinator.store.base import StoreStateLost
from refitplane.errors import Conflict, RefitError, Unavailable
from refitplane.protocol import Backend, Reason, RefitState, Role
from refitplane.protocol import messages as msg
from refitplane.protocol.models import RankProgress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Setup:
    planned: PlannedRefit
    # Every data-plane member of the group, in group-rank order
    group: list[MemberRecord]
    backend: Backend


class JobDriver:
    def __init__(self, job: str, ctx: DriverContext) -> None:
        self.job = job
        self._ctx = ctx
        self._s = ctx.settings
        self._store = ctx.store
        self.current: RefitRun | None = None
        self.groups = GroupEpochs(job, ctx)
        self.replicas = ReplicaHealth(job, ctx.store)
        self.source_digest = ""
        self.target_digest = ""
        self.delivery = PlanDelivery(ctx.settings, ctx.outbox, ctx.metrics)
        self.delta_bases = DeltaBases()
        self._endings = RefitEndings(ctx, self.groups, self.replicas)
        self.held = HeldVersions(job, ctx, self.replicas)
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the job, fail a refit a previous coordinator left in flight, start driving."""
        record = await self._store.load_job(self.job)
        self.groups.load(record.group)
        self.replicas.load(record.replicas)
        if record.active:
            active = await self._store.get_refit(record.active)
            if active is not None and active.state.in_flight:
                await self._endings.orphaned(active)
        self._task = asyncio.create_task(self._loop(), name=f"refit-driver:{self.job}")

    async def stop(self, *, abort_running: bool) -> None:
        """Stop driving. `abort_running`: fail the refit in flight now (graceful stop, its
        participants get AbortRefit); otherwise leave it for the next coordinator."""
        run = self.current
        if abort_running and run is not None:
            run.fail(Reason.COORDINATOR_RESTARTED, "the coordinator is shutting down")
            if not await wait_event(run.finished, 10.0):
                log.warning("refit %s did not finish its abort in time", run.refit_id)
        self._stopping = True
        # Wake the loop too: a cancellation that lands inside a Redis call can be absorbed
        # by the client library, and the loop must still notice it should end.
        self._wake.set()
        await cancel_and_wait(self._task)
        self._task = None

    def wake(self) -> None:
        self._wake.set()

    async def on_held(self, member: MemberRecord, version: int, serving: bool) -> None:
        """A generator rank reported what it holds (RenewLease.held); `HeldVersions` decides
        what that changes, knowing which refit is in flight."""
        await self.held.report(member, version, serving, self.current)

    async def store_lost(self) -> None:
        """The store lost its state (core/lost_state.py): write back what this driver knows
        — the group epoch (its numbering goes on), replica health, the refit in flight —
        and fail that refit STORE_STATE_LOST (its participants get AbortRefit)."""
        await self._store.save_group(self.groups.record)
        await self._store.save_replicas(self.job, self.replicas.records.values())
        run = self.current
        if run is not None:
            await self._store.restore_refit(run.record)
            run.fail(Reason.STORE_STATE_LOST, "the state store lost its state mid-refit")
            if not await wait_event(run.finished, 10.0):
                log.warning("refit %s did not finish its abort in time", run.refit_id)

    def view(self) -> DriverView:
        """What the topology shows of this job beyond the store: a snapshot, not a window."""
        run = self.current
        return DriverView(
            group=self.groups.record,
            replicas=dict(self.replicas.records),
            busy=frozenset(run.cast.participants) if run is not None else frozenset(),
            source_digest=self.source_digest,
            target_digest=self.target_digest,
        )

    async def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                record = await self._store.active_refit(self.job)
            except Unavailable as exc:
                log.warning("job %s: %s; retrying", self.job, exc.message)
                await asyncio.sleep(1.0)
                continue
            try:
                if record is not None and record.state is RefitState.PENDING:
                    await self._drive(record)
                    continue
                if record is not None and record.state.in_flight:
                    await self._endings.orphaned(record)
                    continue
            except Exception:
                # The driver must outlive any one refit; back off and look again.
                log.exception("job %s: driver step failed", self.job)
                await asyncio.sleep(1.0)
                continue
            await wait_event(self._wake, 5.0)

    # --- the state machine ---------------------------------------------------------------

    async def _drive(self, record: RefitRecord) -> None:
        run = RefitRun(record)
        self.current = run
        try:
            # Plan first (memory only), so entering PREPARING is one write that already names
            # the participants; a layout problem still fails the refit at PREPARING.
            setup: _Setup | RefitFailed
            try:
                await await_layouts(
                    run,
                    self._ctx.membership,
                    self.job,
                    self._s.prepare_timeout_s,
                    lambda: self._stopping,
                )
                setup = await self._plan(run)
            except RefitFailed as failure:
                setup = failure
            try:
                await self._enter(run, RefitState.PREPARING, [RefitState.PENDING])
            except Conflict:
                return  # cancelled between the trigger and now
            log.info(
                "refit %s (job %s, version %d) started", run.refit_id, self.job, record.version
            )
            await self._prepare(run, setup)
            await self._transfer(run)
            await self._verify(run)
            await self._commit(run)
        except RefitFailed as failure:
            await self._endings.failed(run, failure)
        except StoreStateLost as exc:
            # Its record went with the store: the store check writes it back (`store_lost`),
            # and the failure below is persisted once it has.
            self._ctx.store_lost()
            await self._endings.failed(run, RefitFailed(Reason.STORE_STATE_LOST, exc.message))
        except RefitError as exc:
            reason = Reason.STORE_UNAVAILABLE if isinstance(exc, Unavailable) else Reason.INTERNAL
            await self._endings.failed(run, RefitFailed(reason, exc.message))
        except Exception as exc:
            log.exception("refit %s: unexpected error", run.refit_id)
            await self._endings.failed(run, RefitFailed(Reason.INTERNAL, type(exc).__name__))
        finally:
            self.current = None
            run.finished.set()

    async def _enter(
        self, run: RefitRun, state: RefitState, expected: list[RefitState], *, publish: bool = True
    ) -> None:
        now = time.time()
        record = run.record.model_copy(
            update={
                "state": state,
                "timings": phase_seconds(run.record, now),
                "phase_started_unix": now,
                "updated_unix": now,
            }
        )
        await self._store.transition(record, expected)
        run.written(record)
        if publish:
            self._ctx.events.publish(record)

    async def _flush(self, run: RefitRun) -> None:
        if run.flush_due():
            record = run.record
            run.written(record)
            await self._store.transition(record, [record.state])
            self._ctx.events.publish(record)  # what changed unpublished (a TransferDone)

    async def _plan(self, run: RefitRun) -> _Setup:
        """Who takes part, at which group ranks, with which plan (nothing is sent yet)."""
        roster = Roster.of(self._ctx.membership.of_job(self.job))
        roster.check_trainers()
        targets = roster.targets(run.record.target_replicas)
        group = roster.group_members()
        rank_of = {m.member_id: i for i, m in enumerate(group)}
        source = [(rank_of[m.member_id], m) for m in roster.trainers]
        target = [(rank_of[m.member_id], m) for rep in targets for m in rep.ordered()]
        # Layouts are checked (and the plan built) before any command goes out.
        planned = await self._ctx.plans.plan(source, target)
        backend = roster.backend(
            ((link.src, link.dst) for link in planned.plan.links), self._s.same_host_transport
        )
        self.source_digest, self.target_digest = planned.source_digest, planned.target_digest

        plan = planned.plan
        run.cast = cast = Cast.of(group, roster.trainers, targets)
        ranks = {
            mid: RankProgress(
                member_id=mid,
                bytes_total=planned.rank_plans[p.group_rank].send_bytes
                if p.member.role is Role.TRAINER
                else planned.rank_plans[p.group_rank].recv_bytes,
            )
            for mid, p in cast.participants.items()
            if p.data_plane
        }
        reusable = self.groups.reusable([m.member_id for m in group], backend)
        run.record = run.record.model_copy(
            update={
                "target_replicas": [rep.replica_id for rep in targets],
                "plan_digest": plan.digest,
                "bytes_total": plan.total_bytes,
                "ranks": ranks,
                "participants": list(cast.participants),
                "group_epoch": reusable.epoch if reusable is not None else 0,
            }
        )
        return _Setup(planned, group, backend)

    async def _prepare(self, run: RefitRun, setup: _Setup | RefitFailed) -> None:
        if isinstance(setup, RefitFailed):
            raise setup
        participants = run.cast.participants
        run.check_alive(self._ctx.membership, participants)
        planned = setup.planned
        epoch = self.groups.reusable([m.member_id for m in setup.group], setup.backend)
        if epoch is None:
            epoch = await self.groups.form(run, setup.group, setup.backend)
            run.record = run.record.model_copy(update={"group_epoch": epoch.epoch})
            await self._store.transition(run.record, [RefitState.PREPARING])
            self._ctx.events.publish(run.record)

        run.commands_sent = True
        self.delivery.begin(run, epoch.epoch)
        # A CUDA IPC group copies at device speed and shares only buffers that live as long
        # as the group (parameters, the staging ring): no deltas, whose payloads are new
        # buffers every refit.
        delta_mode = "off" if setup.backend is Backend.CUDA_IPC else self._s.delta
        run.delta = self.delta_bases.choose(
            delta_mode, run.cast, planned, self._ctx.membership, self.replicas.records
        )
        if run.delta.replicas:
            run.record = run.record.model_copy(update={"delta_replicas": list(run.delta.replicas)})
        # Sidecars first: their PrepareRefit runs vLLM's verbs (pause, start the update), the
        # slowest member's work in the phase; each command wakes its member's pump in turn,
        # so a sidecar's went out after every rank's before.
        for member_id, p in sorted(participants.items(), key=lambda item: item[1].data_plane):
            if p.data_plane:
                self.delivery.send(run, member_id, planned.rank_plans[p.group_rank])
            else:
                self._ctx.outbox.send(
                    member_id,
                    msg.PrepareRefitCmd(
                        refit_id=run.refit_id,
                        version=run.record.version,
                        epoch=epoch.epoch,
                        pause_mode=self._s.pause_mode.value,
                    ),
                )
        everyone = list(participants)
        await run.wait_until(
            lambda: len(run.prepared) == len(everyone),
            timeout_s=self._s.prepare_timeout_s,
            on_timeout=lambda: RefitFailed(
                Reason.TIMEOUT,
                f"PREPARING timed out after {self._s.prepare_timeout_s:g} s waiting for "
                + run.describe([i for i in everyone if i not in run.prepared]),
            ),
        )

    async def _transfer(self, run: RefitRun) -> None:
        await self._enter(run, RefitState.TRANSFERRING, [RefitState.PREPARING], publish=False)
        run.note(start_sent_ns=time.time_ns())  # the hop timeline's first stamp
        for member_id in run.cast.participants:
            # Sidecars: RanksVerified (`on_report`) will say their replica's ranks verified.
            pushed = run.cast.waits_for_ranks_verified(member_id)
            start = msg.StartTransferCmd(run.refit_id, run.record.version, pushed)
            self._ctx.outbox.send(member_id, start)
        self._ctx.events.publish(run.record)  # after: the woken command streams run first
        data = run.cast.data_members()
        await run.wait_until(
            lambda: all(i in run.done for i in data),
            timeout_s=self._s.transfer_timeout_s,
            on_timeout=lambda: RefitFailed(
                Reason.TIMEOUT,
                f"TRANSFERRING timed out after {self._s.transfer_timeout_s:g} s waiting for "
                + run.describe([i for i in data if i not in run.done]),
            ),
            tick=lambda: self._flush(run),
        )
        run.note(transfer_end_ns=time.time_ns())

    async def _verify(self, run: RefitRun) -> None:
        await self._enter(run, RefitState.VERIFYING, [RefitState.TRANSFERRING])
        targets = list(run.cast.replica_ranks)

        async def settle() -> None:
            await self._settle(run)
            await self._flush(run)

        await run.wait_until(
            lambda: all(r in run.record.replicas_done for r in targets),
            timeout_s=self._s.verify_timeout_s,
            on_timeout=lambda: RefitFailed(
                Reason.TIMEOUT,
                f"VERIFYING timed out after {self._s.verify_timeout_s:g} s waiting for "
                "replica(s) "
                + list_some([repr(r) for r in targets if r not in run.record.replicas_done])
                + " to report the new version",
            ),
            tick=settle,
        )

    async def _settle(self, run: RefitRun) -> None:
        """Mark target replicas that hold the new version as done (their members' version
        becomes the refit's), or fail the refit on a replica that cannot."""
        version = run.record.version
        cast = run.cast
        newly = run.newly_settled()
        if not newly:
            return
        run.update(replicas_done=[*run.record.replicas_done, *newly], updated_unix=time.time())
        updated = []
        for replica in newly:
            members = [*cast.replica_ranks[replica]]
            if replica in cast.replica_sidecar:
                members.append(cast.replica_sidecar[replica])
            for member_id in members:
                member = self._ctx.membership.find(member_id)
                if member is not None:
                    updated.append(member.model_copy(update={"version": version}))
        await self._ctx.membership.update_all(updated)  # written together, not one by one
        await self.replicas.set_degraded(newly, degraded=False)
        self._ctx.events.publish(run.record)

    async def _commit(self, run: RefitRun) -> None:
        await self._enter(run, RefitState.COMMITTED, [RefitState.VERIFYING])
        record = run.record
        total = record.updated_unix - record.created_unix
        self._ctx.metrics.finished(RefitState.COMMITTED, record.timings, total, job=record.job)
        self._ctx.metrics.bytes.inc(record.bytes_done)
        self._ctx.metrics.wire_bytes.inc(record.bytes_on_wire)
        deltas = len(record.delta_replicas)
        self._ctx.metrics.delta_replicas.labels("DELTA").inc(deltas)
        self._ctx.metrics.delta_replicas.labels("FULL").inc(len(record.target_replicas) - deltas)
        transfer_s = record.timings.get(RefitState.TRANSFERRING, 0.0)
        if transfer_s > 0 and record.bytes_done:
            self._ctx.metrics.throughput.observe(record.bytes_done / transfer_s)
        log.info(
            "refit %s committed version %d (%d bytes, %.3f s); last reports: %s",
            run.refit_id,
            record.version,
            record.bytes_done,
            total,
            run.critical_path(),
        )

    # --- signals from reports and membership ---------------------------------------------

    async def on_departure(self, member: MemberRecord, why: Departure) -> None:
        self.delivery.forget(member.member_id)
        run = self.current
        if run is not None and (
            member.member_id in run.cast.participants
            or self.groups.formed_by(run, member.member_id)
        ):
            run.fail(why.value, f"{member.describe()}: {why.text}")
        await self.groups.departed(member)

    async def on_report(self, member: MemberRecord, report: msg.Report) -> bool:
        """Apply a report; False when it refers to a refit or epoch that is not current."""
        run = self.current
        body = report.body
        mid = member.member_id
        if is_group_report(report):
            return await self.groups.on_report(run, member, report)
        if (
            run is None
            or report.refit_id != run.refit_id
            or mid not in run.cast.participants
            or run.failure is not None
        ):
            return False
        run.reported(type(body).__name__, mid)
        match body:
            case msg.Prepared():
                run.prepared.add(mid)
                self.delivery.prepared(run, mid)
                run.touch()
            case msg.PlanMissing():
                return self.delivery.plan_missing(run, member, body)
            case msg.Progress():
                run.set_progress(
                    mid, sent=body.bytes_sent, received=body.bytes_received, total=body.bytes_total
                )
                self._ctx.events.publish(run.record)
            case msg.TransferDone():
                recorded_ns = time.time_ns()
                if mid in run.done:  # sent again, its answer lost: applied once
                    return True
                plan = self.delivery.plan_of(run, mid)
                if plan is None:
                    return False  # a sidecar: it reports ReplicaUpdated, never TransferDone
                mismatch = transfer_done_mismatch(plan, body, delta=bool(run.delta.peers.get(mid)))
                if mismatch is not None:
                    run.fail(Reason.REPORT_MISMATCH, f"{member.describe()} reported {mismatch}")
                    return True
                run.done[mid] = body
                if member.role is Role.TRAINER:
                    self.delta_bases.transfer_done(member, body)
                    run.record = run.record.model_copy(
                        update={"bytes_on_wire": run.record.bytes_on_wire + body.bytes_sent}
                    )
                # Ranks send no Progress at the end of a transfer: a finished transfer (its
                # report checked against the plan above) has moved the rank's whole share.
                # Progress counts the share, not the wire: a delta's body carries the (fewer)
                # bytes on the wire, which bytes_on_wire keeps for the trainers.
                run.set_progress(
                    mid,
                    sent=plan.send_bytes,
                    received=plan.recv_bytes,
                    total=plan.send_bytes + plan.recv_bytes,
                    verified=body.tensors_verified,
                    tensors=body.tensors_total,
                )
                run.set_hops(mid, body.hops, recorded_ns)
                # Not published: watchers get it with the phase's end or the next flush,
                # not converted for them while other reports wait (the report path, docs).
                if (told := run.ranks_verified(member)) is not None:
                    self._ctx.outbox.send(*told)  # RanksVerified: the sidecar waits for it
            case msg.ReplicaUpdated():
                replica = member.replica_id
                sidecar = run.cast.replica_sidecar.get(replica)
                by_rank0 = sidecar is None and member.role is Role.GENERATOR and member.rank == 0
                if replica not in run.cast.replica_ranks or not (mid == sidecar or by_rank0):
                    return False
                run.replica_updated[replica] = body.version
                run.touch()
            case msg.Failure():
                if body.weights_modified and member.role is not Role.TRAINER:
                    run.weights_modified.add(member.replica_id)
                if member.role is Role.TRAINER:
                    self.delta_bases.forget(mid)
                run.fail(body.reason, f"{member.describe()}: {body.message or body.reason}")
        return True
