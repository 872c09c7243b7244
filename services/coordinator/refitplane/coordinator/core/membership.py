"""Membership: registrations, TTL leases, layouts published, members lost or replaced.

The live view is in memory (the coordinator is the single writer) and every durable change
is written through to the store. Lease renewals touch memory only: after a restart every
member gets one fresh TTL of grace, so leases need not be persisted.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

from refitplane.coordinator.auth import credential_matches, new_member_credential
from refitplane.coordinator.core.records import MemberRecord
from refitplane.coordinator.core.validation import check_member
from refitplane.coordinator.store.base import Store
from refitplane.errors import NotFound, PermissionDenied, Unauthenticated
from refitplane.protocol import MemberState, Role
from refitplane.protocol.channel import MEMBER_CREDENTIAL_KEY
from refitplane.protocol.messages import MemberInfo
from refitplane.reshard.layout import Layout

log = logging.getLogger(__name__)

# LOST members stay visible in the topology this many TTLs, then they are forgotten.
LOST_RETENTION_TTLS = 10


class Departure(enum.StrEnum):
    """Why a member stopped being usable; also the refit failure reason it causes."""

    LEASE_EXPIRED = "LEASE_EXPIRED"
    MEMBER_REPLACED = "MEMBER_REPLACED"
    MEMBER_LEFT = "MEMBER_LEFT"

    @property
    def text(self) -> str:
        """What happened to the member, as a refit's failure message says it."""
        return _DEPARTURE_TEXT[self]


_DEPARTURE_TEXT = {
    Departure.LEASE_EXPIRED: "lease expired",
    Departure.MEMBER_REPLACED: "re-registered under the same key (replaced)",
    Departure.MEMBER_LEFT: "deregistered",
}


DepartureListener = Callable[[MemberRecord, Departure], Awaitable[None]]


class Membership:
    def __init__(self, store: Store, *, lease_ttl_s: float, allowed_jobs: Iterable[str]) -> None:
        self._store = store
        self.ttl = lease_ttl_s
        self._allowed = frozenset(allowed_jobs)
        self._members: dict[str, MemberRecord] = {}
        self._by_job: dict[str, dict[str, str]] = collections.defaultdict(dict)
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._listeners: list[DepartureListener] = []

    def on_departure(self, listener: DepartureListener) -> None:
        self._listeners.append(listener)

    async def _depart(self, member: MemberRecord, why: Departure) -> None:
        for listener in self._listeners:
            await listener(member, why)

    # --- loading -------------------------------------------------------------------------

    async def load(self) -> None:
        """Read every member from the store; live ones get one TTL of grace."""
        expires = time.time() + self.ttl
        for m in await self._store.load_members():
            if m.alive:
                m = m.model_copy(update={"lease_expires_unix": expires})
            self._put(m)
        log.info("loaded %d members from the %s store", len(self._members), self._store.kind)

    def _put(self, member: MemberRecord) -> None:
        self._members[member.member_id] = member
        self._by_job[member.job][member.key] = member.member_id

    def _drop(self, member: MemberRecord) -> None:
        self._members.pop(member.member_id, None)
        index = self._by_job.get(member.job)
        if index is not None and index.get(member.key) == member.member_id:
            del index[member.key]
            if not index:
                del self._by_job[member.job]

    # --- queries -------------------------------------------------------------------------

    def get(self, member_id: str) -> MemberRecord:
        member = self._members.get(member_id)
        if member is None:
            raise NotFound(f"member {member_id!r} is not registered", field="member_id")
        return member

    def get_live(self, member_id: str) -> MemberRecord:
        """A registered member whose lease is live (LOST members must register again)."""
        member = self.get(member_id)
        if not member.alive:
            raise NotFound(
                f"member {member_id!r} was lost (lease expired); register again", field="member_id"
            )
        return member

    def authenticate(self, member_id: str, credential: str) -> MemberRecord:
        """The registered member `member_id`, if `credential` is the one it was issued.
        UNAUTHENTICATED without a credential; NOT_FOUND for an unknown member (its agent
        registers again); PERMISSION_DENIED for a credential of anyone else."""
        if not credential:
            raise Unauthenticated("missing member credential", field=MEMBER_CREDENTIAL_KEY)
        member = self.get(member_id)
        if not member.credential_sha256:
            # Registered before credentials existed: nobody can prove to be it.
            raise NotFound(
                f"member {member_id!r} has no credential on record; register again",
                field="member_id",
            )
        if not credential_matches(credential, member.credential_sha256):
            raise PermissionDenied(
                f"the member credential presented is not member {member_id!r}'s",
                field=MEMBER_CREDENTIAL_KEY,
            )
        return member

    def find(self, member_id: str) -> MemberRecord | None:
        return self._members.get(member_id)

    def all(self) -> list[MemberRecord]:
        return list(self._members.values())

    def forget_all(self) -> list[MemberRecord]:
        """Drop every member from memory, without departures: the store lost them (see
        `lost_state`). Their next call is NOT_FOUND and their agents register again."""
        dropped = list(self._members.values())
        self._members.clear()
        self._by_job.clear()
        return dropped

    def of_job(self, job: str) -> list[MemberRecord]:
        index = self._by_job.get(job, {})
        return [self._members[i] for i in index.values()]

    def has_job(self, job: str) -> bool:
        return job in self._by_job

    def allowed(self, job: str) -> bool:
        return not self._allowed or job in self._allowed

    def jobs(self) -> list[str]:
        return sorted(self._by_job)

    def live(self) -> list[MemberRecord]:
        return [m for m in self._members.values() if m.alive]

    def job_lock(self, job: str) -> asyncio.Lock:
        """The lock registrations of `job` take (held while an idle job is forgotten)."""
        return self._locks[job]

    def forget_job(self, job: str) -> None:
        """Drop what is kept per job once it was forgotten (it has no members)."""
        lock = self._locks.get(job)
        if job not in self._by_job and lock is not None and not lock.locked():
            del self._locks[job]

    def count_by_state(self) -> dict[MemberState, int]:
        return dict(collections.Counter(m.state for m in self._members.values()))

    def __len__(self) -> int:
        return len(self._members)

    # --- changes -------------------------------------------------------------------------

    async def register(self, info: MemberInfo) -> tuple[MemberRecord, str]:
        """Register (replacing the member with the same key); returns the member and its
        credential, which only the caller ever sees."""
        check_member(info)
        if not self.allowed(info.job):
            raise NotFound(f"job {info.job!r} is not in REFIT_ALLOWED_JOBS", field="job")
        now = time.time()
        credential, digest = new_member_credential()
        member = MemberRecord(
            member_id=uuid.uuid4().hex,
            credential_sha256=digest,
            job=info.job,
            role=info.role,
            replica_id=info.replica_id,
            rank=info.rank,
            world_size=info.world_size,
            host=info.host,
            device=info.device,
            node=info.node,
            device_uuid=info.device_uuid,
            labels=dict(info.labels),
            version=info.version if info.role is not Role.TRAINER else 0,
            delta_receive=info.delta_receive and info.role is Role.GENERATOR,
            state=MemberState.JOINING if info.role.is_data_plane else MemberState.READY,
            registered_unix=now,
            lease_expires_unix=now + self.ttl,
        )
        async with self._locks[info.job]:
            old_id = await self._store.register_member(member)
            old = self._members.get(old_id) if old_id else None
            if old is None:
                # The store knew nothing to replace; memory may still hold a LOST member.
                index = self._by_job.get(info.job, {})
                prev = index.get(member.key)
                old = self._members.get(prev) if prev else None
            if old is not None:
                self._drop(old)
            self._put(member)
        if old is not None:
            log.info("%s replaced %s", member.describe(), old.member_id)
            await self._depart(old, Departure.MEMBER_REPLACED)
        else:
            log.info("registered %s in job %s", member.describe(), member.job)
        return member, credential

    def renew(self, member_id: str) -> MemberRecord:
        member = self.get_live(member_id)
        member = member.model_copy(update={"lease_expires_unix": time.time() + self.ttl})
        self._members[member_id] = member
        return member

    async def publish_layout(self, member_id: str, layout: Layout) -> MemberRecord:
        member = self.get_live(member_id)
        async with self._locks[member.job]:
            member = self.get_live(member_id)
            if member.layout_digest == layout.digest and member.state is MemberState.READY:
                return member
            member = member.model_copy(
                update={"layout_digest": layout.digest, "state": MemberState.READY}
            )
            await self._store.save_member(member)
            # Keep a lease renewed while the store was being written.
            current = self._members.get(member_id)
            if current is None:
                raise NotFound(f"member {member_id!r} left while publishing", field="member_id")
            member = member.model_copy(update={"lease_expires_unix": current.lease_expires_unix})
            self._members[member_id] = member
        return member

    async def update(self, member: MemberRecord) -> None:
        """Persist a changed member (e.g. its version after a commit), if still registered."""
        await self.update_all([member])

    async def update_all(self, members: Iterable[MemberRecord]) -> None:
        """`update` for several members of one job, their writes in flight together: a
        replica's ranks all take a refit's version at once, and on Redis one write after
        another cost a round trip per rank between the last report and COMMITTED."""
        changed: list[MemberRecord] = []
        for member in members:
            current = self._members.get(member.member_id)
            if current is not None:
                lease = current.lease_expires_unix
                changed.append(member.model_copy(update={"lease_expires_unix": lease}))
        if not changed:
            return

        async def save(member: MemberRecord) -> None:
            if member.member_id in self._members:
                await self._store.save_member(member)
                self._members[member.member_id] = member

        jobs = {m.job for m in changed}
        if len(jobs) > 1:
            raise ValueError(f"update_all takes members of one job, got {sorted(jobs)}")
        async with self._locks[changed[0].job]:
            await asyncio.gather(*(save(m) for m in changed))

    async def deregister(self, member_id: str) -> None:
        member = self.get(member_id)
        async with self._locks[member.job]:
            await self._store.delete_member(member)
            self._drop(member)
        log.info("deregistered %s", member.describe())
        if member.alive:
            await self._depart(member, Departure.MEMBER_LEFT)

    async def expire(self, now: float | None = None) -> list[MemberRecord]:
        """Mark members whose lease ran out as LOST; forget long-lost ones. Returns the
        newly lost."""
        now = time.time() if now is None else now
        lost: list[MemberRecord] = []
        for member in list(self._members.values()):
            if member.alive and member.lease_expires_unix < now:
                # Memory first: from here on renewals answer NOT_FOUND, so the member
                # re-registers instead of racing this write.
                updated = member.model_copy(update={"state": MemberState.LOST})
                self._members[member.member_id] = updated
                lost.append(updated)
                async with self._locks[member.job]:
                    if self._members.get(member.member_id) is updated:
                        await self._store.save_member(updated)
            elif (
                not member.alive
                and member.lease_expires_unix + LOST_RETENTION_TTLS * self.ttl < now
            ):
                async with self._locks[member.job]:
                    await self._store.delete_member(member)
                    self._drop(member)
        for member in lost:
            log.warning("lease expired: %s", member.describe())
            await self._depart(member, Departure.LEASE_EXPIRED)
        return lost
