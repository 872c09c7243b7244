"""The refit state machine of one job: PENDING → PREPARING → TRANSFERRING → VERIFYING →
COMMITTED, or FAILED / CANCELLED with a reason. One driver task per job runs one refit at a
time; it is the only writer of the refit it drives (cancel and reports only signal it).

Group epochs are formed here too, on demand, by the refit that needs one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from refitplane.coordinator.core.events import RefitEvents
from refitplane.coordinator.core.failures import Reason, RefitFailed, list_some
from refitplane.coordinator.core.membership import Departure, Membership
from refitplane.coordinator.core.metrics import Metrics
from refitplane.coordinator.core.outbox import Outbox
from refitplane.coordinator.core.planning import PlanCache, PlanHoldings, PlannedRefit, Roster
from refitplane.coordinator.core.records import (
    GroupRecord,
    GroupState,
    MemberRecord,
    RefitRecord,
    ReplicaRecord,
)
from refitplane.coordinator.core.run import Participant, RefitRun, phase_seconds
from refitplane.coordinator.core.waits import wait_event
from refitplane.coordinator.settings import Settings
from refitplane.coordinator.store.base import Store
from refitplane.errors import Conflict, RefitError, Unavailable
from refitplane.protocol import Backend, RefitState, Role
from refitplane.protocol import messages as msg
from refitplane.protocol.models import RankProgress

log = logging.getLogger(__name__)

# Progress is persisted at most this often (watchers see every change in memory).
FLUSH_INTERVAL_S = 0.5
# A rendezvous blob larger than this is refused (NCCL ids are 128 bytes per channel).
MAX_RENDEZVOUS_BYTES = 64 * 1024
# A member that reports PlanMissing again after the body was sent this often fails the refit
# (once is the normal case: it evicted or lost the plan).
MAX_PLAN_RESENDS = 2
_DEPARTURE_TEXT = {
    Departure.LEASE_EXPIRED: "lease expired",
    Departure.MEMBER_REPLACED: "re-registered under the same key (replaced)",
    Departure.MEMBER_LEFT: "deregistered",
}


@dataclass(frozen=True)
class _Setup:
    planned: PlannedRefit
    # Every data-plane member of the group, in group-rank order
    group: list[MemberRecord]
    backend: Backend


@dataclass
class DriverContext:
    """What every job driver shares."""

    settings: Settings
    store: Store
    membership: Membership
    outbox: Outbox
    events: RefitEvents
    metrics: Metrics
    plans: PlanCache


class JobDriver:
    def __init__(self, job: str, ctx: DriverContext) -> None:
        self.job = job
        self._ctx = ctx
        self._s = ctx.settings
        self._store = ctx.store
        self.current: RefitRun | None = None
        self.group = GroupRecord(job=job)
        self.replicas: dict[str, ReplicaRecord] = {}
        self.source_digest = ""
        self.target_digest = ""
        # Which members hold which rank plans: PrepareRefit names those instead of sending them.
        self.plan_holdings = PlanHoldings()
        # Trainer member id → (its layout digest, the version it keeps as its delta base),
        # from its last TransferDone. In memory only: after a restart refits go in full
        # until every trainer sent once more.
        self.delta_bases: dict[str, tuple[str, int]] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the job, fail a refit a previous coordinator left in flight, start driving."""
        record = await self._store.load_job(self.job)
        self.group = record.group
        self.replicas = dict(record.replicas)
        if record.active:
            active = await self._store.get_refit(record.active)
            if active is not None and active.state.in_flight:
                await self._fail_orphan(active)
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
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def wake(self) -> None:
        self._wake.set()

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
                    await self._fail_orphan(record)
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
                await self._await_layouts(run)
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
            await self._finish_failed(run, failure)
        except RefitError as exc:
            reason = Reason.STORE_UNAVAILABLE if isinstance(exc, Unavailable) else Reason.INTERNAL
            await self._finish_failed(run, RefitFailed(reason, exc.message))
        except Exception as exc:
            log.exception("refit %s: unexpected error", run.refit_id)
            await self._finish_failed(run, RefitFailed(Reason.INTERNAL, type(exc).__name__))
        finally:
            self.current = None
            run.finished.set()

    async def _enter(self, run: RefitRun, state: RefitState, expected: list[RefitState]) -> None:
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
        run.record = record
        run.dirty = False
        run.last_flush = time.monotonic()
        self._ctx.events.publish(record)

    async def _flush(self, run: RefitRun) -> None:
        if run.dirty and time.monotonic() - run.last_flush >= FLUSH_INTERVAL_S:
            run.dirty = False
            run.last_flush = time.monotonic()
            await self._store.transition(run.record, [run.record.state])

    async def _await_layouts(self, run: RefitRun) -> None:
        """A member publishes its layout right after it (re-)registers — a trainer rejoining
        after a stall, a restarted vLLM worker. A refit triggered in between waits for those
        layouts (up to the prepare timeout, counted from each registration) instead of
        failing at once with LAYOUT_MISSING; members registered longer ago than that are not
        waited for (planning then names them)."""
        window = self._s.prepare_timeout_s
        logged = False
        while True:
            if run.failure is not None:  # cancelled while waiting
                raise run.failure
            now = time.time()
            joining = [
                m
                for m in self._ctx.membership.of_job(self.job)
                if m.alive
                and m.role.is_data_plane
                and not m.layout_digest
                and now - m.registered_unix < window
            ]
            if not joining or self._stopping:
                return
            if not logged:
                log.info(
                    "refit %s waits for the layout of %s (registered %.2f s ago)",
                    run.refit_id,
                    list_some([m.describe() for m in joining]),
                    now - max(m.registered_unix for m in joining),
                )
                logged = True
            run.changed.clear()
            # Layouts arrive over RPCs that do not signal the run: look again soon.
            await wait_event(run.changed, 0.02)

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
        backend = roster.backend()
        self.source_digest, self.target_digest = planned.source_digest, planned.target_digest

        plan = planned.plan
        run.members = {m.member_id: m for m in group}
        ranks: dict[str, RankProgress] = {}
        for g, m in source:
            run.participants[m.member_id] = Participant(m, g)
            ranks[m.member_id] = RankProgress(
                member_id=m.member_id, bytes_total=planned.rank_plans[g].send_bytes
            )
        for rep in targets:
            run.replica_ranks[rep.replica_id] = [m.member_id for m in rep.ordered()]
            for m in rep.ordered():
                g = rank_of[m.member_id]
                run.participants[m.member_id] = Participant(m, g)
                ranks[m.member_id] = RankProgress(
                    member_id=m.member_id, bytes_total=planned.rank_plans[g].recv_bytes
                )
            if rep.sidecar is not None:
                run.participants[rep.sidecar.member_id] = Participant(rep.sidecar, -1)
                run.members[rep.sidecar.member_id] = rep.sidecar
                run.replica_sidecar[rep.replica_id] = rep.sidecar.member_id
        reusable = self._reusable_group([m.member_id for m in group], backend)
        run.record = run.record.model_copy(
            update={
                "target_replicas": [rep.replica_id for rep in targets],
                "plan_digest": plan.digest,
                "bytes_total": plan.total_bytes,
                "ranks": ranks,
                "participants": list(run.participants),
                "group_epoch": reusable.epoch if reusable is not None else 0,
            }
        )
        return _Setup(planned, group, backend)

    def _reusable_group(self, member_ids: list[str], backend: Backend) -> GroupRecord | None:
        g = self.group
        if (
            g.state is GroupState.READY
            and g.members == member_ids
            and g.backend is backend
            and g.num_channels == self._s.num_channels
        ):
            return g
        return None

    async def _prepare(self, run: RefitRun, setup: _Setup | RefitFailed) -> None:
        if isinstance(setup, RefitFailed):
            raise setup
        self._check_alive(run, run.participants)
        planned = setup.planned
        epoch = self._reusable_group([m.member_id for m in setup.group], setup.backend)
        if epoch is None:
            epoch = await self._ensure_group(run, setup.group, setup.backend)
            run.record = run.record.model_copy(update={"group_epoch": epoch.epoch})
            await self._store.transition(run.record, [RefitState.PREPARING])
            self._ctx.events.publish(run.record)

        run.commands_sent = True
        run.prepare_epoch = epoch.epoch
        self._choose_delta(run, planned)
        for member_id, p in run.participants.items():
            if p.data_plane:
                run.rank_plans[member_id] = planned.rank_plans[p.group_rank]
                self._send_prepare(run, member_id, resend=False)
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
        everyone = list(run.participants)
        await run.wait_until(
            lambda: len(run.prepared) == len(everyone),
            timeout_s=self._s.prepare_timeout_s,
            on_timeout=lambda: RefitFailed(
                Reason.TIMEOUT,
                f"PREPARING timed out after {self._s.prepare_timeout_s:g} s waiting for "
                + run.describe([i for i in everyone if i not in run.prepared]),
            ),
        )

    def _send_prepare(self, run: RefitRun, member_id: str, *, resend: bool) -> None:
        """PrepareRefit for a data-plane member: its plan named by digest and rank, with the
        body only if the member has not acknowledged holding it (under this member id, in
        this epoch) or reported it missing (`resend`)."""
        plan = run.rank_plans[member_id]
        key = (plan.plan_digest, plan.rank)
        named_only = not resend and self.plan_holdings.holds(member_id, run.prepare_epoch, key)
        self._ctx.outbox.send(
            member_id,
            msg.PrepareRefitCmd(
                refit_id=run.refit_id,
                version=run.record.version,
                epoch=run.prepare_epoch,
                plan=None if named_only else plan,
                config=self._s.transfer_config(),
                plan_digest=plan.plan_digest,
                plan_rank=plan.rank,
                delta_peers=run.delta_peers.get(member_id, frozenset()),
                delta_base_version=run.delta_base_version,
            ),
        )
        how = "resent" if resend else "reference" if named_only else "body"
        self._ctx.metrics.rank_plans.labels(how).inc()

    def _choose_delta(self, run: RefitRun, planned: PlannedRefit) -> None:
        """Which target replicas take a delta: those whose every rank holds, intact, the
        version every trainer rank keeps as its delta base (taken of the layout it has now)
        and can apply one in place. Everyone else, a first refit, a new or restarted
        trainer, a changed trainer layout or a DEGRADED replica gets the full path."""
        if self._s.delta == "off":
            return
        # Only the ranks that send in this refit need a base (a DP copy that the planner
        # leaves idle sends nothing).
        trainers = [
            p.member
            for p in run.participants.values()
            if p.member.role is Role.TRAINER and planned.rank_plans[p.group_rank].send_bytes
        ]
        if not trainers:
            return
        bases = set()
        for trainer in trainers:
            current = self._ctx.membership.find(trainer.member_id)
            held = self.delta_bases.get(trainer.member_id)
            if current is None or held is None or held[0] != current.layout_digest:
                return
            bases.add(held[1])
        if len(bases) != 1:
            return
        base = bases.pop()
        chosen: list[str] = []
        for replica, rank_ids in run.replica_ranks.items():
            record = self.replicas.get(replica)
            if record is not None and record.degraded:
                continue
            members = [self._ctx.membership.find(i) for i in rank_ids]
            if all(m is not None and m.delta_receive and m.version == base for m in members):
                chosen.append(replica)
        if not chosen:
            return
        trainer_ranks = frozenset(run.participants[t.member_id].group_rank for t in trainers)
        receiver_ranks: set[int] = set()
        for replica in chosen:
            for member_id in run.replica_ranks[replica]:
                run.delta_peers[member_id] = trainer_ranks
                receiver_ranks.add(run.participants[member_id].group_rank)
        for trainer in trainers:
            run.delta_peers[trainer.member_id] = frozenset(receiver_ranks)
        run.delta_base_version = base
        run.record = run.record.model_copy(update={"delta_replicas": sorted(chosen)})

    def _on_plan_missing(self, run: RefitRun, member: MemberRecord, body: msg.PlanMissing) -> bool:
        """A member does not hold the plan its PrepareRefit named: send it the body (the
        refit goes on; PREPARING's deadline still bounds it)."""
        mid = member.member_id
        plan = run.rank_plans.get(mid)
        if (
            plan is None
            or (plan.plan_digest, plan.rank) != (body.plan_digest, body.plan_rank)
            or mid in run.prepared
            or run.transfer_started
        ):
            return False
        self.plan_holdings.forget(mid, (plan.plan_digest, plan.rank))
        resends = run.plan_resends.get(mid, 0)
        if resends >= MAX_PLAN_RESENDS:
            run.fail(
                Reason.PLAN_MISSING,
                f"{member.describe()} reported plan {plan.plan_digest[:12]} (rank {plan.rank}) "
                f"missing again after it was sent {resends} time(s): {body.message}",
            )
            return True
        run.plan_resends[mid] = resends + 1
        log.info(
            "refit %s: %s does not hold plan %s rank %d (%s): sending it",
            run.refit_id,
            member.describe(),
            plan.plan_digest[:12],
            plan.rank,
            body.message,
        )
        self._send_prepare(run, mid, resend=True)
        return True

    def _check_alive(self, run: RefitRun, member_ids: Iterable[str]) -> None:
        """Members may have left while the plan was built; fail now rather than time out."""
        for member_id in member_ids:
            member = self._ctx.membership.find(member_id)
            if member is None:
                who = run.describe([member_id])
                raise RefitFailed(Reason.MEMBER_LEFT, f"{who} is no longer registered")
            if not member.alive:
                raise RefitFailed(Reason.LEASE_EXPIRED, f"{member.describe()}: lease expired")

    async def _ensure_group(
        self, run: RefitRun, members: list[MemberRecord], backend: Backend
    ) -> GroupRecord:
        """Form a new epoch of exactly these members (the current one cannot be reused)."""
        ids = [m.member_id for m in members]
        old = self.group
        new = GroupRecord(
            job=self.job,
            epoch=old.epoch + 1,
            state=GroupState.FORMING,
            backend=backend,
            members=ids,
            num_channels=self._s.num_channels,
        )
        await self._store.save_group(new)
        self.group = new
        self._ctx.metrics.epochs.inc()
        log.info(
            "job %s: group epoch %d (%s, %d ranks)", self.job, new.epoch, backend.value, new.size
        )
        if old.members and old.state is not GroupState.NONE:
            for member_id in old.members:
                member = self._ctx.membership.find(member_id)
                if member is not None and member.alive:
                    self._ctx.outbox.send(member_id, msg.LeaveGroupCmd(epoch=old.epoch, abort=True))
        run.forming_epoch = new.epoch
        run.forming_members = ids
        run.rendezvous = None
        run.joined = set()
        timeout = self._s.group_timeout_s
        try:
            self._check_alive(run, ids)
            self._ctx.outbox.send(
                ids[0],
                msg.CreateRendezvousCmd(
                    epoch=new.epoch,
                    backend=backend,
                    group_size=new.size,
                    num_channels=new.num_channels,
                ),
            )
            await run.wait_until(
                lambda: run.rendezvous is not None,
                timeout_s=timeout,
                on_timeout=lambda: RefitFailed(
                    Reason.GROUP_FAILED,
                    f"group epoch {new.epoch}: no rendezvous from {run.describe(ids[:1])} "
                    f"within {timeout:g} s",
                ),
            )
            rendezvous = run.rendezvous or b""
            for rank, member_id in enumerate(ids):
                self._ctx.outbox.send(
                    member_id,
                    msg.JoinGroupCmd(
                        epoch=new.epoch,
                        backend=backend,
                        group_rank=rank,
                        group_size=new.size,
                        num_channels=new.num_channels,
                        rendezvous=rendezvous,
                        timeout_s=timeout,
                    ),
                )
            await run.wait_until(
                lambda: len(run.joined) == len(ids),
                timeout_s=timeout,
                on_timeout=lambda: RefitFailed(
                    Reason.GROUP_FAILED,
                    f"group epoch {new.epoch}: {run.describe([i for i in ids if i not in run.joined])}"
                    f" did not join within {timeout:g} s",
                ),
            )
        except RefitFailed:
            await self._poison()
            raise
        finally:
            run.forming_epoch = 0
        ready = new.model_copy(update={"state": GroupState.READY})
        await self._store.save_group(ready)
        self.group = ready
        return ready

    async def _poison(self) -> None:
        # Store first: a write lost to a store outage leaves memory unchanged, so the
        # caller's retry writes it again (memory first, the retry saw nothing to do and a
        # restarted coordinator reloaded a READY group whose communicators were aborted).
        if self.group.state in (GroupState.READY, GroupState.FORMING):
            poisoned = self.group.model_copy(update={"state": GroupState.POISONED})
            await self._store.save_group(poisoned)
            self.group = poisoned

    async def _transfer(self, run: RefitRun) -> None:
        await self._enter(run, RefitState.TRANSFERRING, [RefitState.PREPARING])
        run.transfer_started = True
        for member_id in run.participants:
            self._ctx.outbox.send(
                member_id, msg.StartTransferCmd(refit_id=run.refit_id, version=run.record.version)
            )
        data = run.data_members()
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

    async def _verify(self, run: RefitRun) -> None:
        await self._enter(run, RefitState.VERIFYING, [RefitState.TRANSFERRING])
        targets = list(run.replica_ranks)

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
        newly: list[str] = []
        for replica, rank_ids in run.replica_ranks.items():
            if replica in run.record.replicas_done:
                continue
            updated = run.replica_updated.get(replica)
            if updated is not None and updated != version:
                raise RefitFailed(
                    Reason.VERSION_MISMATCH,
                    f"replica {replica!r} reported version {updated}, the refit is {version}",
                )
            if replica in run.replica_sidecar:
                if updated == version:
                    newly.append(replica)
                continue
            if not all(i in run.done for i in rank_ids):
                continue
            short = [
                i for i in rank_ids if run.done[i].tensors_verified < run.done[i].tensors_total
            ]
            if short:
                raise RefitFailed(
                    Reason.VERIFY_FAILED,
                    f"replica {replica!r}: {run.describe(short)} verified fewer tensors than "
                    "they received",
                )
            newly.append(replica)
        if not newly:
            return
        run.record = run.record.model_copy(
            update={
                "replicas_done": [*run.record.replicas_done, *newly],
                "updated_unix": time.time(),
            }
        )
        run.dirty = True
        for replica in newly:
            members = [*run.replica_ranks[replica]]
            if replica in run.replica_sidecar:
                members.append(run.replica_sidecar[replica])
            for member_id in members:
                member = self._ctx.membership.find(member_id)
                if member is not None:
                    await self._ctx.membership.update(
                        member.model_copy(update={"version": version})
                    )
        await self._set_degraded(newly, degraded=False)
        self._ctx.events.publish(run.record)

    async def _set_degraded(self, replicas: Iterable[str], *, degraded: bool) -> None:
        changed = []
        for replica in replicas:
            old = self.replicas.get(replica)
            if old is None or old.degraded != degraded:
                changed.append(ReplicaRecord(replica_id=replica, degraded=degraded))
        if changed:
            # Store first, as in `_poison`: a failed write is retried, not forgotten.
            await self._store.save_replicas(self.job, changed)
            for record in changed:
                self.replicas[record.replica_id] = record

    async def _commit(self, run: RefitRun) -> None:
        await self._enter(run, RefitState.COMMITTED, [RefitState.VERIFYING])
        record = run.record
        total = record.updated_unix - record.created_unix
        self._ctx.metrics.finished(RefitState.COMMITTED, record.timings, total)
        self._ctx.metrics.bytes.inc(record.bytes_done)
        self._ctx.metrics.wire_bytes.inc(record.bytes_on_wire)
        deltas = len(record.delta_replicas)
        self._ctx.metrics.delta_replicas.labels("delta").inc(deltas)
        self._ctx.metrics.delta_replicas.labels("full").inc(len(record.target_replicas) - deltas)
        transfer_s = record.timings.get(RefitState.TRANSFERRING, 0.0)
        if transfer_s > 0 and record.bytes_done:
            self._ctx.metrics.throughput.observe(record.bytes_done / transfer_s / 1e9)
        log.info(
            "refit %s committed version %d (%d bytes, %.3f s)",
            run.refit_id,
            record.version,
            record.bytes_done,
            total,
        )

    async def _finish_failed(self, run: RefitRun, failure: RefitFailed) -> None:
        cancelled = run.cancelled and failure.reason == Reason.CANCELLED
        state = RefitState.CANCELLED if cancelled else RefitState.FAILED
        if run.commands_sent:
            abort = msg.AbortRefitCmd(
                refit_id=run.refit_id, reason=failure.reason, message=failure.message
            )
            for member_id in run.participants:
                self._ctx.outbox.send(member_id, abort)
        # A replica whose weights may have changed: one that said so, or one that was told to
        # transfer into live parameters and did not finish (ranks receiving into staging —
        # label receive_mode=staged — keep their weights until the reload, which reports).
        degraded = [
            r
            for r in run.replica_ranks
            if r not in run.record.replicas_done
            and (
                r in run.weights_modified or (run.transfer_started and not _receives_staged(run, r))
            )
        ]
        now = time.time()
        record = run.record.model_copy(
            update={
                "state": state,
                "reason": failure.reason,
                "message": failure.message,
                "timings": phase_seconds(run.record, now),
                "phase_started_unix": now,
                "updated_unix": now,
                "replicas_degraded": degraded,
            }
        )
        log.warning(
            "refit %s %s: %s: %s",
            run.refit_id,
            state.value.lower(),
            failure.reason,
            failure.message,
        )
        for attempt in range(10):
            try:
                if run.commands_sent:
                    await self._poison()
                await self._set_degraded(degraded, degraded=True)
                await self._store.transition(record, [run.record.state])
                break
            except Unavailable:
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        else:
            log.error("refit %s: could not persist its %s state", run.refit_id, state.value)
        run.record = record
        self._ctx.events.publish(record)
        self._ctx.metrics.finished(state, record.timings, now - record.created_unix)

    async def _fail_orphan(self, record: RefitRecord) -> None:
        """A refit in flight that no task drives: its coordinator stopped. Fail it; its
        participants get AbortRefit when their command streams reconnect."""
        message = f"the coordinator restarted while the refit was {record.state.value}"
        for member_id in record.participants:
            self._ctx.outbox.send(
                member_id,
                msg.AbortRefitCmd(
                    refit_id=record.refit_id,
                    reason=Reason.COORDINATOR_RESTARTED,
                    message=message,
                ),
            )
        degraded = []
        if record.state in (RefitState.TRANSFERRING, RefitState.VERIFYING):
            degraded = [r for r in record.target_replicas if r not in record.replicas_done]
        await self._poison()
        await self._set_degraded(degraded, degraded=True)
        now = time.time()
        failed = record.model_copy(
            update={
                "state": RefitState.FAILED,
                "reason": Reason.COORDINATOR_RESTARTED.value,
                "message": message,
                "timings": phase_seconds(record, now),
                "phase_started_unix": now,
                "updated_unix": now,
                "replicas_degraded": degraded,
            }
        )
        try:
            await self._store.transition(failed, [record.state])
        except Conflict:
            return
        log.warning("refit %s failed: %s", record.refit_id, message)
        self._ctx.events.publish(failed)
        self._ctx.metrics.finished(RefitState.FAILED, failed.timings, now - record.created_unix)

    # --- signals from reports and membership ---------------------------------------------

    async def on_departure(self, member: MemberRecord, why: Departure) -> None:
        self.plan_holdings.forget(member.member_id)
        run = self.current
        if run is not None and (
            member.member_id in run.participants or member.member_id in run.forming_members
        ):
            run.fail(why.value, f"{member.describe()}: {_DEPARTURE_TEXT[why]}")
        if member.member_id in self.group.members and self.group.state is GroupState.READY:
            # The next refit needs a new epoch anyway (membership differs); say so now.
            await self._poison()

    async def on_report(self, member: MemberRecord, report: msg.Report) -> bool:
        """Apply a report; False when it refers to a refit or epoch that is not current."""
        run = self.current
        body = report.body
        mid = member.member_id
        if isinstance(body, msg.RendezvousReady | msg.GroupJoined):
            if run is None or not run.forming_epoch or body.epoch != run.forming_epoch:
                return False
            if isinstance(body, msg.RendezvousReady):
                if mid != run.forming_members[0]:
                    return False
                if not body.rendezvous or len(body.rendezvous) > MAX_RENDEZVOUS_BYTES:
                    run.fail(
                        Reason.GROUP_FAILED,
                        f"{member.describe()} reported a rendezvous of {len(body.rendezvous)} "
                        f"bytes (must be 1..{MAX_RENDEZVOUS_BYTES})",
                    )
                    return True
                run.rendezvous = body.rendezvous
            elif mid in run.forming_members:
                run.joined.add(mid)
            else:
                return False
            run.touch()
            return True
        if isinstance(body, msg.Failure) and not report.refit_id:
            if run is not None and run.forming_epoch and body.epoch == run.forming_epoch:
                if mid not in run.forming_members:
                    return False
                run.fail(
                    Reason.GROUP_FAILED,
                    f"{member.describe()} failed to set up group epoch {body.epoch}: "
                    f"{body.reason}: {body.message}",
                )
                return True
            if body.epoch == self.group.epoch and mid in self.group.members:
                await self._poison()
                return True
            return False
        if (
            run is None
            or report.refit_id != run.refit_id
            or mid not in run.participants
            or run.failure is not None
        ):
            return False
        match body:
            case msg.Prepared():
                run.prepared.add(mid)
                plan = run.rank_plans.get(mid)
                if plan is not None:
                    self.plan_holdings.acknowledge(
                        mid, run.prepare_epoch, (plan.plan_digest, plan.rank)
                    )
                run.touch()
            case msg.PlanMissing():
                return self._on_plan_missing(run, member, body)
            case msg.Progress():
                run.set_progress(
                    mid, sent=body.bytes_sent, received=body.bytes_received, total=body.bytes_total
                )
                self._ctx.events.publish(run.record)
            case msg.TransferDone():
                run.done[mid] = body
                if member.role is Role.TRAINER:
                    if body.delta_base_version:
                        self.delta_bases[mid] = (member.layout_digest, body.delta_base_version)
                    else:
                        self.delta_bases.pop(mid, None)
                    run.record = run.record.model_copy(
                        update={"bytes_on_wire": run.record.bytes_on_wire + body.bytes_sent}
                    )
                run.set_progress(
                    mid,
                    sent=body.bytes_sent,
                    received=body.bytes_received,
                    total=0,
                    verified=body.tensors_verified,
                    tensors=body.tensors_total,
                )
                self._ctx.events.publish(run.record)
            case msg.ReplicaUpdated():
                replica = member.replica_id
                sidecar = run.replica_sidecar.get(replica)
                by_rank0 = sidecar is None and member.role is Role.GENERATOR and member.rank == 0
                if replica not in run.replica_ranks or not (mid == sidecar or by_rank0):
                    return False
                run.replica_updated[replica] = body.version
                run.touch()
            case msg.Failure():
                if body.weights_modified and member.role is not Role.TRAINER:
                    run.weights_modified.add(member.replica_id)
                if member.role is Role.TRAINER:
                    # Whatever the trainer's base is now, the next refit does not rely on it.
                    self.delta_bases.pop(mid, None)
                run.fail(body.reason, f"{member.describe()}: {body.message or body.reason}")
        return True


def _receives_staged(run: RefitRun, replica: str) -> bool:
    ranks = run.replica_ranks.get(replica, [])
    return bool(ranks) and all(
        (m := run.members.get(mid)) is not None and m.labels.get("receive_mode") == "staged"
        for mid in ranks
    )
