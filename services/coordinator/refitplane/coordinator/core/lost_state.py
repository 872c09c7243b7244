"""A store that lost its state is detected, never silently re-seeded.

Redis may come back empty (no AOF, a wiped or replaced instance). Without a check the
coordinator would carry on: the refit in flight vanishes, the next trigger is handed
version 1 while replicas hold 3, member records are never written back. So:

* **Detect.** At start the coordinator claims the store's incarnation sentinel (a random id
  under `incarnation`; a fresh store gets a new one). `StoreWatch` compares it every
  `check_interval_s`, and every trigger checks it inside its Lua script, so no version is
  ever handed out by a store that lost its state (`StoreStateLost`, UNAVAILABLE).
* **Not ready.** From detection until the store is re-seeded and the members it knew have
  registered again (or one lease TTL passed), `/readyz` answers 503 and gRPC health
  NOT_SERVING; triggers answer UNAVAILABLE until the store is re-seeded.
* **Re-seed from what the coordinator and the members know.** Each job's versions are
  raised to at least the highest this coordinator handed out or saw committed and the
  highest any member holds (`VersionFloors`); each driver writes back its group epoch
  (numbering goes on), its replica health, and the refit in flight, which then fails
  `STORE_STATE_LOST`. Every member is then forgotten: its next call is NOT_FOUND, its agent
  registers again with the version it holds (which raises the job's last-used version
  again, in `register.lua`) and publishes its layout again (layouts were lost too). Version
  numbers are never reused. The idempotency keys this coordinator handed out are written
  back too (`idempotency_keys`), so a key does not create a second refit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from refitplane.coordinator.core.idempotency_keys import KeyMemory
from refitplane.coordinator.core.membership import Membership
from refitplane.coordinator.core.records import JobRecord, RefitRecord
from refitplane.coordinator.core.waits import cancel_and_wait, wait_event
from refitplane.coordinator.store.base import Store
from refitplane.errors import Unavailable
from refitplane.protocol import RefitState, Role

log = logging.getLogger(__name__)

ReadinessListener = Callable[[bool], Awaitable[None]]


class VersionFloors:
    """Per job, the highest version this coordinator handed out and the highest it saw
    committed (from the store at start and every refit record it publishes): what re-seeds
    a store that lost them."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._committed: dict[str, int] = {}

    def load(self, record: JobRecord) -> None:
        self._raise(record.job, record.last_version, record.committed_version)

    def seen(self, record: RefitRecord) -> None:
        committed = record.version if record.state is RefitState.COMMITTED else 0
        self._raise(record.job, record.version, committed)

    def _raise(self, job: str, last: int, committed: int) -> None:
        self._last[job] = max(self._last.get(job, 0), last, committed)
        self._committed[job] = max(self._committed.get(job, 0), committed)

    def jobs(self) -> list[str]:
        return sorted(self._last)

    def of(self, job: str) -> tuple[int, int]:
        """(last version used, last committed) as far as this coordinator knows."""
        return self._last.get(job, 0), self._committed.get(job, 0)


class StoreWatch:
    """Watches the store's incarnation sentinel and runs the recovery above."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        floors: VersionFloors,
        keys: KeyMemory,
        *,
        reseed_drivers: Callable[[], Awaitable[None]],
        forget_streams: Callable[[list[str]], None],
        check_interval_s: float,
        lease_ttl_s: float,
    ) -> None:
        self._store = store
        self._membership = membership
        self._floors = floors
        self._keys = keys
        self._reseed_drivers = reseed_drivers
        self._forget_streams = forget_streams
        self._interval = check_interval_s
        self._ttl = lease_ttl_s
        self._incarnation = ""
        self._ready = True
        self._listeners: list[ReadinessListener] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.recoveries = 0

    @property
    def ready(self) -> bool:
        return self._ready

    def on_readiness(self, listener: ReadinessListener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        self._incarnation = await self._store.claim_incarnation()
        self._task = asyncio.create_task(self._loop(), name="store-watch")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def suspect(self) -> None:
        """A write found the sentinel gone: check now rather than at the next tick."""
        self._wake.set()

    async def _set_ready(self, ready: bool) -> None:
        if ready == self._ready:
            return
        self._ready = ready
        for listener in self._listeners:
            try:
                await listener(ready)
            except Exception:
                log.exception("readiness listener failed")

    async def _loop(self) -> None:
        while True:
            await wait_event(self._wake, self._interval)
            self._wake.clear()
            try:
                if await self._store.incarnation() != self._incarnation:
                    await self._recover()
            except Unavailable:
                continue  # unreachable is not lost: the next check decides
            except Exception:
                log.exception("store check failed")

    async def _recover(self) -> None:
        await self._set_ready(False)
        self.recoveries += 1
        log.error(
            "the state store lost its state (its incarnation sentinel is gone): not ready; "
            "re-seeding it from this coordinator's memory and the members"
        )
        members = [m for m in self._membership.all() if m.alive]
        held: dict[str, int] = {}
        for m in members:
            if m.role is not Role.TRAINER:
                held[m.job] = max(held.get(m.job, 0), m.version)
        jobs = {*held, *(m.job for m in members), *self._floors.jobs()}
        await self._reseed_drivers()
        for job in sorted(jobs):
            last, committed = self._floors.of(job)
            await self._store.raise_versions(
                job, last_version=max(last, held.get(job, 0)), committed_version=committed
            )
        # After the drivers: a key naming the refit in flight finds it written back.
        remembered = self._keys.live()
        for k in remembered:
            await self._store.restore_idempotency_key(k.job, k.key, k.refit, k.ttl_s)
        self._incarnation = await self._store.claim_incarnation()
        dropped = self._membership.forget_all()
        self._forget_streams([m.member_id for m in dropped])
        log.warning(
            "state store re-seeded (incarnation %s): versions of %d job(s) and %d idempotency "
            "key(s) restored; waiting for %d member(s) to register again",
            self._incarnation[:8],
            len(jobs),
            len(remembered),
            len(members),
        )
        await self._await_members({(m.job, m.key) for m in members})
        await self._set_ready(True)

    async def _await_members(self, expected: set[tuple[str, str]]) -> None:
        """Until every member the lost store knew registered again, or one lease TTL passed
        (a member that does not come back within a TTL would have been lost anyway)."""
        deadline = time.monotonic() + self._ttl
        while time.monotonic() < deadline:
            back = {(m.job, m.key) for m in self._membership.all() if m.alive}
            if expected <= back:
                return
            await asyncio.sleep(0.05)
        missing = expected - {(m.job, m.key) for m in self._membership.all()}
        log.warning("%d member(s) did not register again within a lease TTL", len(missing))
