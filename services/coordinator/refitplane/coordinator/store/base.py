"""The state store interface: what the coordinator persists and the atomic steps it needs.

Two implementations share this interface and one test suite: `EmbeddedStore` (in-process,
the default without a Redis URL) and `RedisStore` (redis-py asyncio; atomic steps are the
checked-in Lua scripts in `lua/`). The coordinator keeps the live view of members in memory
and writes through; the store is what survives a coordinator restart.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

from refitplane.coordinator.core.records import (
    GroupRecord,
    JobRecord,
    MemberRecord,
    PlanInfo,
    RefitRecord,
    ReplicaRecord,
    TriggerRequest,
    TriggerResult,
)
from refitplane.errors import Conflict, FailedPrecondition, InvalidArgument, Unavailable
from refitplane.protocol import RefitState

# Versions stay below 10^14: Redis' Lua numbers and cjson (14 significant digits) stay exact.
MAX_VERSION = 10**14 - 1
# Finished refit records kept per job (older ones are dropped when a refit finishes).
REFITS_KEPT_PER_JOB = 1000


class StoreStateLost(Unavailable):
    """The store answers, but not with the state this coordinator wrote: its incarnation
    sentinel is gone or another (a wiped or replaced Redis). Callers see UNAVAILABLE; the
    coordinator re-seeds the store from what it and the members know."""


def stale_version_error(asked: int, last: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"version {asked} is not greater than the last version used for this job ({last})",
        field="version",
    )


def transition_conflict(refit_id: str, current: str, expected: Iterable[RefitState]) -> Conflict:
    wanted = ", ".join(sorted(s.value for s in expected))
    return Conflict(
        f"refit {refit_id} is {current}; this step needs it to be {wanted}", field="state"
    )


def version_too_large_error(asked: int) -> InvalidArgument:
    return InvalidArgument(f"version {asked} exceeds the maximum {MAX_VERSION}", field="version")


class Store(abc.ABC):
    """Persistence for one coordinator. Methods raise `refitplane.errors.Unavailable` when
    the backing service cannot be reached."""

    kind: str

    @abc.abstractmethod
    async def ping(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # --- lost state ------------------------------------------------------------------------

    @abc.abstractmethod
    async def claim_incarnation(self) -> str:
        """The store's incarnation sentinel: the one it holds, or a new one written now (a
        fresh — or wiped — store). Later writes that must not land in a lost store (triggers)
        check it; the coordinator compares it on every check."""

    @abc.abstractmethod
    async def incarnation(self) -> str | None:
        """The sentinel the store holds now (None: none — it lost its state)."""

    @abc.abstractmethod
    async def raise_versions(self, job: str, *, last_version: int, committed_version: int) -> None:
        """Re-seed: raise the job's last-used and committed versions to at least these (never
        lowers them), and list the job."""

    @abc.abstractmethod
    async def restore_refit(self, refit: RefitRecord) -> None:
        """Re-seed: write back a refit the store forgot, as the job's active refit."""

    @abc.abstractmethod
    async def restore_idempotency_key(
        self, job: str, key: str, refit: RefitRecord, ttl_s: int
    ) -> None:
        """Re-seed: write back idempotency key `key` of `job`, naming `refit` (written back
        too, into the job's history, unless the store holds it), for `ttl_s` more seconds.
        Neither overwrites what the store holds."""

    # --- members -------------------------------------------------------------------------

    @abc.abstractmethod
    async def register_member(self, member: MemberRecord) -> str | None:
        """Store `member`, atomically replacing the member with the same key in its job, and
        raise the job's last-used version to the version the member holds (the next refit
        goes above every version a member holds). Returns the replaced member's id."""

    @abc.abstractmethod
    async def save_member(self, member: MemberRecord) -> None:
        """Upsert a member's record, indexing it under its key unless another member holds
        the key (it was replaced). Only members the coordinator holds are saved."""

    @abc.abstractmethod
    async def delete_member(self, member: MemberRecord) -> None: ...

    @abc.abstractmethod
    async def load_members(self) -> list[MemberRecord]:
        """Every registered member of every job (coordinator start-up)."""

    # --- layouts and plans ---------------------------------------------------------------

    @abc.abstractmethod
    async def put_layout(self, digest: str, doc: str) -> None:
        """Content-addressed: the same digest always names the same document."""

    @abc.abstractmethod
    async def get_layout(self, digest: str) -> str | None:
        """A stored layout (reading it, like storing it, restarts its TTL where it has one)."""

    async def touch_layouts(self, digests: Iterable[str]) -> None:
        """Restart the TTL of layouts still in use (no-op for a store without TTLs)."""
        del digests

    @abc.abstractmethod
    async def put_plan_info(self, info: PlanInfo) -> None: ...

    @abc.abstractmethod
    async def get_plan_info(self, key: str) -> PlanInfo | None: ...

    # --- jobs ----------------------------------------------------------------------------

    @abc.abstractmethod
    async def jobs(self) -> list[str]: ...

    @abc.abstractmethod
    async def forget_job(self, job: str) -> bool:
        """Drop `job` from `jobs()` if, atomically, it has no member and no active or
        pending refit (True); its version counters are kept. False: the job is in use."""

    @abc.abstractmethod
    async def load_job(self, job: str) -> JobRecord: ...

    @abc.abstractmethod
    async def save_group(self, group: GroupRecord) -> None: ...

    @abc.abstractmethod
    async def save_replicas(self, job: str, replicas: Iterable[ReplicaRecord]) -> None: ...

    # --- refits --------------------------------------------------------------------------

    @abc.abstractmethod
    async def trigger(self, request: TriggerRequest) -> TriggerResult:
        """Idempotency, version allocation and coalescing in one atomic step (see
        `lua/trigger.lua`). Raises FailedPrecondition naming `version` when it is stale."""

    @abc.abstractmethod
    async def transition(self, refit: RefitRecord, expected: Iterable[RefitState]) -> None:
        """Write `refit` if the stored state is one of `expected`, else raise Conflict
        (NotFound if unknown). Terminal states also promote the job's pending refit and, for
        COMMITTED, raise the job's committed version."""

    @abc.abstractmethod
    async def active_refit(self, job: str) -> RefitRecord | None:
        """The job's active refit (the one its driver runs next or now), in one read."""

    @abc.abstractmethod
    async def get_refit(self, refit_id: str) -> RefitRecord | None: ...

    @abc.abstractmethod
    async def list_refits(self, job: str, limit: int) -> list[RefitRecord]:
        """Newest first."""
