"""`Coordinator`: the one core both transports call. It owns membership, the per-job refit
drivers, the command outbox, plans and metrics; every method takes and returns domain types
(`refitplane.protocol`: messages and models), never protobuf or HTTP objects."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from refitplane.coordinator.core.context import DriverContext
from refitplane.coordinator.core.driver import JobDriver
from refitplane.coordinator.core.events import RefitEvents
from refitplane.coordinator.core.idempotency_keys import KeyMemory
from refitplane.coordinator.core.idle_jobs import IdleClock, sweep_interval
from refitplane.coordinator.core.lost_state import ReadinessListener, StoreWatch, VersionFloors
from refitplane.coordinator.core.membership import Departure, Membership
from refitplane.coordinator.core.metrics import Metrics
from refitplane.coordinator.core.outbox import Outbox
from refitplane.coordinator.core.planning import LayoutCache, PlanCache
from refitplane.coordinator.core.ratelimit import TriggerRateLimiter
from refitplane.coordinator.core.records import (
    MemberRecord,
    RefitRecord,
    TriggerOutcome,
    TriggerRequest,
    TriggerResult,
)
from refitplane.coordinator.core.topology import DriverView, JobSnapshot, job_topology
from refitplane.coordinator.core.validation import (
    check_idempotency_key,
    check_member_id,
    check_name,
    check_refit_id,
    check_targets,
    check_version,
)
from refitplane.coordinator.core.waits import cancel_and_wait, get_within, wait_event
from refitplane.coordinator.settings import Settings
from refitplane.coordinator.store.base import Store, StoreStateLost
from refitplane.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RateLimited,
    Unavailable,
)
from refitplane.protocol import Reason, RefitState, Role
from refitplane.protocol import messages as msg
from refitplane.protocol.models import Refit, Topology
from refitplane.reshard.layout import Layout

log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 1000
# How often leases are checked, as a fraction of the TTL (bounded below for tiny test TTLs).
_REAP_FRACTION = 0.1
# How often the store's incarnation sentinel is checked (a store that lost its state).
_STORE_CHECK_S = 0.5


class Coordinator:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.membership = Membership(
            store, lease_ttl_s=settings.lease_ttl_s, allowed_jobs=settings.allowed_jobs
        )
        self.outbox = Outbox()
        self.events = RefitEvents()
        self.metrics = Metrics(self.membership.count_by_state, self._replica_versions)
        self.layouts = LayoutCache(store)
        self.plans = PlanCache(store, self.layouts, allow_unused=settings.allow_unused_tensors)
        self._ctx = DriverContext(
            settings,
            store,
            self.membership,
            self.outbox,
            self.events,
            self.metrics,
            self.plans,
            store_lost=lambda: self.store_watch.suspect(),
        )
        self._drivers: dict[str, JobDriver] = {}
        self._driver_lock = asyncio.Lock()
        self._limiter = TriggerRateLimiter(settings.trigger_rate_per_s)
        self._reaper: asyncio.Task[None] | None = None
        self._idle = IdleClock(settings.job_idle_s)
        self._collector: asyncio.Task[None] | None = None
        self.membership.on_departure(self._on_departure)
        self.floors = VersionFloors()
        self.events.observe(self.floors.seen)
        self.keys = KeyMemory()
        self.events.observe(self.keys.seen)
        self.store_watch = StoreWatch(
            store,
            self.membership,
            self.floors,
            self.keys,
            reseed_drivers=self._reseed_drivers,
            forget_streams=self._forget_streams,
            check_interval_s=_STORE_CHECK_S,
            lease_ttl_s=settings.lease_ttl_s,
        )

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.ping()
        await self.store_watch.start()
        await self.membership.load()
        for job in sorted({*await self.store.jobs(), *self.membership.jobs()}):
            self.floors.load(await self.store.load_job(job))
            await self._driver(job)
        self._reaper = asyncio.create_task(self._reap(), name="lease-reaper")
        self._collector = asyncio.create_task(self._collect(), name="idle-job-collector")

    def on_readiness(self, listener: ReadinessListener) -> None:
        """`listener(ready)` whenever readiness changes (a store that lost its state)."""
        self.store_watch.on_readiness(listener)

    async def _reseed_drivers(self) -> None:
        self.layouts.forget()  # members publish theirs again when they register again
        for driver in list(self._drivers.values()):
            await driver.store_lost()

    def _forget_streams(self, member_ids: list[str]) -> None:
        for member_id in member_ids:
            self.outbox.close(member_id)

    async def stop(self, *, graceful: bool = True) -> None:
        """Stop driving refits. Graceful: refits in flight fail now and their participants
        get AbortRefit; otherwise they are left for the next coordinator to fail."""
        await self.store_watch.stop()
        for task in (self._reaper, self._collector):
            await cancel_and_wait(task)
        await asyncio.gather(*(d.stop(abort_running=graceful) for d in self._drivers.values()))
        self._drivers.clear()

    async def close(self) -> None:
        await self.store.close()

    async def _reap(self) -> None:
        interval = max(0.05, min(1.0, self.settings.lease_ttl_s * _REAP_FRACTION))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.membership.expire()
            except Exception:
                log.exception("lease check failed")

    async def _driver(self, job: str) -> JobDriver:
        driver = self._drivers.get(job)
        if driver is not None:
            return driver
        async with self._driver_lock:
            driver = self._drivers.get(job)
            if driver is None:
                driver = JobDriver(job, self._ctx)
                await driver.start()
                self._drivers[job] = driver
                self.metrics.jobs_driven.set(len(self._drivers))
        return driver

    # --- idle jobs -----------------------------------------------------------------------

    def _is_idle(self, job: str) -> bool:
        driver = self._drivers.get(job)
        return driver is not None and driver.current is None and not self.membership.of_job(job)

    async def _collect(self) -> None:
        s = self.settings
        interval = sweep_interval(s.job_idle_s, s.layout_ttl_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.collect_idle_jobs()
                digests = {m.layout_digest for m in self.membership.live() if m.layout_digest}
                await self.store.touch_layouts(sorted(digests))
            except Exception:
                log.exception("idle-job sweep failed")

    async def collect_idle_jobs(self, now: float | None = None) -> list[str]:
        """Forget jobs idle for REFIT_JOB_IDLE_S: stop their drivers and take them out of
        the store's job set (atomically refused if a member or a refit appeared meanwhile).
        A job that comes back (a member registers, a trigger) gets a new driver."""
        now = time.monotonic() if now is None else now
        forgotten = []
        for job in self._idle.due(now, {job: self._is_idle(job) for job in self._drivers}):
            self._idle.reset(job)
            # Both locks: no driver is made, and no member of the job registers, while the
            # job is checked and forgotten.
            async with self._driver_lock, self.membership.job_lock(job):
                driver = self._drivers.get(job)
                if driver is None or not self._is_idle(job) or not await self.store.forget_job(job):
                    continue
                del self._drivers[job]
                self.metrics.jobs_driven.set(len(self._drivers))
            await driver.stop(abort_running=False)
            self.membership.forget_job(job)
            self._limiter.forget(job)
            forgotten.append(job)
        if forgotten:
            self.metrics.jobs_forgotten.inc(len(forgotten))
            log.info("forgot %d idle job(s), e.g. %s", len(forgotten), forgotten[0])
        return forgotten

    async def _on_departure(self, member: MemberRecord, why: Departure) -> None:
        self.outbox.close(member.member_id)
        driver = self._drivers.get(member.job)
        if driver is not None:
            await driver.on_departure(member, why)

    async def ready(self) -> None:
        """Raises Unavailable when the store cannot be reached, or lost its state and is
        being re-seeded."""
        await self.store.ping()
        if not self.store_watch.ready:
            raise Unavailable("the state store lost its state; re-seeding it from the members")

    # --- agents --------------------------------------------------------------------------

    async def register(self, info: msg.MemberInfo) -> tuple[MemberRecord, str]:
        """The new member and its credential (every later call must present it)."""
        member, credential = await self.membership.register(info)
        await self._driver(member.job)
        return member, credential

    def authenticate(self, member_id: str, credential: str) -> MemberRecord:
        """The member a call names, if the caller proved to be it (see `Membership`)."""
        return self.membership.authenticate(check_member_id(member_id), credential)

    async def renew(
        self, member_id: str, *, credential: str, held: tuple[int, bool] | None = None
    ) -> MemberRecord:
        """Renew the lease; `held`: a generator's (version it holds, serving), which
        settles a replica a coordinator restart left unverified."""
        self.authenticate(member_id, credential)
        member = self.membership.renew(member_id)
        driver = self._drivers.get(member.job)
        if held is not None and member.role is Role.GENERATOR and driver is not None:
            await driver.on_held(member, *held)
        return member

    def member(self, member_id: str, *, credential: str) -> MemberRecord:
        """A live member (NOT_FOUND when unknown or lost)."""
        self.authenticate(member_id, credential)
        return self.membership.get_live(member_id)

    async def publish_layout(
        self, member_id: str, layout: Layout, *, credential: str
    ) -> MemberRecord:
        member = self.member(member_id, credential=credential)
        if not member.role.is_data_plane:
            raise InvalidArgument("sidecars do not publish layouts", field="member_id")
        if not len(layout):
            raise InvalidArgument("the layout lists no tensors", field="layout.tensors")
        await self.layouts.put(layout)
        return await self.membership.publish_layout(member_id, layout)

    async def stream(self, member_id: str, *, credential: str) -> AsyncIterator[msg.Command]:
        self.member(member_id, credential=credential)
        async for command in self.outbox.stream(member_id):
            yield command

    async def report(self, report: msg.Report, *, credential: str) -> bool:
        member = self.authenticate(report.member_id, credential)
        if not member.alive:
            return False
        driver = self._drivers.get(member.job)
        return driver is not None and await driver.on_report(member, report)

    async def deregister(self, member_id: str, *, credential: str) -> None:
        self.authenticate(member_id, credential)
        await self.membership.deregister(member_id)

    # --- orchestrators -------------------------------------------------------------------

    async def trigger(
        self,
        job: str,
        *,
        target_replicas: list[str] | None = None,
        idempotency_key: str = "",
        version: int = 0,
    ) -> Refit:
        check_name(job, "job")
        targets = check_targets(list(target_replicas or []))
        check_idempotency_key(idempotency_key)
        check_version(version)
        self._check_job(job)
        if targets:
            known = {m.replica_id for m in self.membership.of_job(job) if m.replica_id}
            unknown = [r for r in targets if r not in known]
            if unknown:
                raise NotFound(
                    f"job {job!r} has no replica {unknown[0]!r}", field="target_replicas"
                )
        try:
            self._limiter.check(job)
        except RateLimited:
            self.metrics.triggers.labels("RATE_LIMITED").inc()
            raise
        try:
            result = await self._store_trigger(job, version, targets, idempotency_key)
        except StoreStateLost:
            self.store_watch.suspect()
            raise
        self.floors.seen(result.refit)
        self.keys.remember(job, idempotency_key, result.refit)
        self.metrics.triggers.labels(result.outcome.name).inc()
        if result.outcome is TriggerOutcome.COALESCED:
            self.events.publish(result.refit)
        driver = await self._driver(job)
        driver.wake()
        return self._live(result.refit).view()

    async def _store_trigger(
        self, job: str, version: int, targets: list[str], idempotency_key: str
    ) -> TriggerResult:
        return await self.store.trigger(
            TriggerRequest(
                job=job,
                version=version,
                target_replicas=targets,
                idempotency_key=idempotency_key,
                now=time.time(),
                new_id=uuid.uuid4().hex,
            )
        )

    def _check_job(self, job: str) -> None:
        if self.settings.allowed_jobs:
            if job not in self.settings.allowed_jobs:
                raise NotFound(f"job {job!r} is not in REFIT_ALLOWED_JOBS", field="job")
        elif not self.membership.has_job(job):
            raise NotFound(f"job {job!r} has no registered members", field="job")

    def _live(self, record: RefitRecord) -> RefitRecord:
        """The freshest copy: the driver's in-memory record while it drives this refit."""
        driver = self._drivers.get(record.job)
        run = driver.current if driver is not None else None
        if run is not None and run.refit_id == record.refit_id:
            return run.record
        return record

    async def _record(self, refit_id: str) -> RefitRecord:
        check_refit_id(refit_id)
        record = await self.store.get_refit(refit_id)
        if record is None:
            # The refit being driven is known in memory even if the store lost it (it is
            # written back when the loss is detected, see lost_state).
            for driver in self._drivers.values():
                run = driver.current
                if run is not None and run.refit_id == refit_id:
                    return run.record
            raise NotFound(f"refit {refit_id!r} not found", field="refit_id")
        return self._live(record)

    async def get_refit(self, refit_id: str) -> Refit:
        return (await self._record(refit_id)).view()

    async def list_refits(self, job: str, limit: int = 50) -> list[Refit]:
        check_name(job, "job")
        if limit < 1 or limit > MAX_LIST_LIMIT:
            raise InvalidArgument(f"limit must be 1..{MAX_LIST_LIMIT}", field="limit")
        records = await self.store.list_refits(job, limit)
        if not records and not self._known_job(job):
            # As topology answers: an empty list would hide a misspelt job name.
            raise NotFound(f"job {job!r} is unknown", field="job")
        return [self._live(r).view() for r in records]

    def _replica_versions(self) -> list[tuple[str, str, int]]:
        """(job, replica, version) per generator replica: the lowest version its members
        hold (a rank that missed a refit holds the older one)."""
        lowest: dict[tuple[str, str], int] = {}
        for job in self.membership.jobs():
            for member in self.membership.of_job(job):
                if member.role is Role.TRAINER or not member.replica_id:
                    continue
                key = (job, member.replica_id)
                lowest[key] = min(lowest.get(key, member.version), member.version)
        return [(job, replica, version) for (job, replica), version in sorted(lowest.items())]

    def _known_job(self, job: str) -> bool:
        """A job with members, a driver (it has refits) or named in REFIT_ALLOWED_JOBS."""
        return (
            bool(self.membership.of_job(job))
            or job in self._drivers
            or job in self.settings.allowed_jobs
        )

    async def cancel(self, refit_id: str) -> Refit:
        record = await self._record(refit_id)
        for _ in range(3):
            if record.state.terminal:
                raise FailedPrecondition(
                    f"refit {refit_id} is already {record.state.value}", field="refit_id"
                )
            driver = self._drivers.get(record.job)
            run = driver.current if driver is not None else None
            if run is not None and run.refit_id == refit_id:
                run.cancel()
                if not await wait_event(run.finished, 30.0):
                    log.warning("refit %s: cancel still in progress", refit_id)
                return (await self._record(refit_id)).view()
            if record.state is RefitState.PENDING:
                now = time.time()
                cancelled = record.model_copy(
                    update={
                        "state": RefitState.CANCELLED,
                        "reason": Reason.CANCELLED,
                        "message": "cancelled by request before it started",
                        "updated_unix": now,
                    }
                )
                try:
                    await self.store.transition(cancelled, [RefitState.PENDING])
                except Conflict:
                    record = await self._record(refit_id)  # the driver picked it up
                    continue
                self.events.publish(cancelled)
                self.metrics.finished(
                    RefitState.CANCELLED, {}, now - record.created_unix, job=record.job
                )
                if driver is not None:
                    driver.wake()
                return cancelled.view()
            await asyncio.sleep(0.05)
            record = await self._record(refit_id)
        raise Conflict(f"refit {refit_id} changed state while cancelling; retry", field="refit_id")

    async def watch(self, refit_id: str, *, heartbeat_s: float = 15.0) -> AsyncIterator[Refit]:
        """The record now and on every change, until it is terminal."""
        with self.events.subscribe(refit_id) as changes:
            record = await self._record(refit_id)
            yield record.view()
            while not record.state.terminal:
                latest = await get_within(changes, heartbeat_s)
                if latest is None:
                    latest = await self._record(refit_id)
                    if latest == record:
                        continue
                record = latest
                yield record.view()

    async def topology(self, job: str) -> Topology:
        check_name(job, "job")
        members = self.membership.of_job(job)
        driver = self._drivers.get(job)
        if not members and driver is None:
            if not self._known_job(job):
                raise NotFound(f"job {job!r} is unknown", field="job")
            return Topology(job=job)
        record = await self.store.load_job(job)
        view = driver.view() if driver is not None else DriverView(record.group, record.replicas)
        return job_topology(JobSnapshot(job, members, record.committed_version, view))
