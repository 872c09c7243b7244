"""The embedded in-process store: dictionaries, no I/O. The default when no Redis URL is
configured (single-node demos, tests); state lives as long as the process.

Every method runs without awaiting anything, so each one is atomic on the event loop —
the same guarantee the Lua scripts give the Redis store.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from refitplane.coordinator.core.records import (
    GroupRecord,
    JobRecord,
    MemberRecord,
    PlanInfo,
    RefitRecord,
    ReplicaRecord,
    TriggerOutcome,
    TriggerRequest,
    TriggerResult,
)
from refitplane.coordinator.store.base import (
    MAX_VERSION,
    REFITS_KEPT_PER_JOB,
    Store,
    stale_version_error,
    transition_conflict,
    version_too_large_error,
)
from refitplane.errors import NotFound
from refitplane.protocol import RefitState


@dataclass
class _Job:
    active: str = ""
    pending: str = ""
    last_version: int = 0
    committed_version: int = 0
    members: dict[str, str] = field(default_factory=dict)  # member key → member id
    refits: list[str] = field(default_factory=list)  # oldest first
    idempotency: dict[str, tuple[str, float]] = field(default_factory=dict)  # key → (id, expiry)
    group: GroupRecord | None = None
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    # False once forgotten (idle): out of `jobs()`, version counters kept.
    listed: bool = True


class EmbeddedStore(Store):
    kind = "embedded"

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._members: dict[str, MemberRecord] = {}
        self._layouts: dict[str, str] = {}
        self._plans: dict[str, PlanInfo] = {}
        self._refits: dict[str, RefitRecord] = {}
        self._incarnation = uuid.uuid4().hex

    def _job(self, job: str) -> _Job:
        return self._jobs.setdefault(job, _Job())

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    # The process's memory cannot lose part of its state: the sentinel never changes.
    async def claim_incarnation(self) -> str:
        return self._incarnation

    async def incarnation(self) -> str | None:
        return self._incarnation

    async def raise_versions(self, job: str, *, last_version: int, committed_version: int) -> None:
        j = self._job(job)
        j.last_version = max(j.last_version, last_version)
        j.committed_version = max(j.committed_version, committed_version)

    async def restore_refit(self, refit: RefitRecord) -> None:
        j = self._job(refit.job)
        if refit.refit_id not in self._refits:
            j.refits.append(refit.refit_id)
        self._refits[refit.refit_id] = refit
        j.active = refit.refit_id

    async def restore_idempotency_key(
        self, job: str, key: str, refit: RefitRecord, ttl_s: int
    ) -> None:
        j = self._job(job)
        if refit.refit_id not in self._refits:
            self._refits[refit.refit_id] = refit
            j.refits.append(refit.refit_id)
        j.idempotency.setdefault(key, (refit.refit_id, time.time() + ttl_s))

    async def register_member(self, member: MemberRecord) -> str | None:
        job = self._job(member.job)
        job.listed = True
        old = job.members.get(member.key)
        job.members[member.key] = member.member_id
        self._members[member.member_id] = member
        job.last_version = max(job.last_version, member.version)
        if old is not None and old != member.member_id:
            self._members.pop(old, None)
            return old
        return None

    async def save_member(self, member: MemberRecord) -> None:
        index = self._job(member.job).members
        holder = index.setdefault(member.key, member.member_id)
        if holder == member.member_id:
            self._members[member.member_id] = member

    async def delete_member(self, member: MemberRecord) -> None:
        job = self._job(member.job)
        if job.members.get(member.key) == member.member_id:
            del job.members[member.key]
        self._members.pop(member.member_id, None)

    async def load_members(self) -> list[MemberRecord]:
        return list(self._members.values())

    async def put_layout(self, digest: str, doc: str) -> None:
        self._layouts.setdefault(digest, doc)

    async def get_layout(self, digest: str) -> str | None:
        return self._layouts.get(digest)

    async def put_plan_info(self, info: PlanInfo) -> None:
        self._plans[info.key] = info

    async def get_plan_info(self, key: str) -> PlanInfo | None:
        return self._plans.get(key)

    async def jobs(self) -> list[str]:
        return sorted(name for name, j in self._jobs.items() if j.listed)

    async def forget_job(self, job: str) -> bool:
        j = self._jobs.get(job)
        if j is None or j.members or j.active or j.pending:
            return j is None
        j.listed = False
        return True

    async def load_job(self, job: str) -> JobRecord:
        j = self._jobs.get(job) or _Job()
        return JobRecord(
            job=job,
            active=j.active,
            pending=j.pending,
            last_version=j.last_version,
            committed_version=j.committed_version,
            group=j.group or GroupRecord(job=job),
            replicas=dict(j.replicas),
        )

    async def save_group(self, group: GroupRecord) -> None:
        self._job(group.job).group = group

    async def save_replicas(self, job: str, replicas: Iterable[ReplicaRecord]) -> None:
        j = self._job(job)
        for r in replicas:
            j.replicas[r.replica_id] = r

    async def trigger(self, request: TriggerRequest) -> TriggerResult:
        job = self._job(request.job)
        job.listed = True
        key = request.idempotency_key
        if key:
            hit = job.idempotency.get(key)
            if hit is not None and hit[1] > time.time() and hit[0] in self._refits:
                return TriggerResult(refit=self._refits[hit[0]], outcome=TriggerOutcome.EXISTING)
        version = request.version or job.last_version + 1
        if version <= job.last_version:
            raise stale_version_error(request.version, job.last_version)
        if version > MAX_VERSION:
            raise version_too_large_error(version)
        job.last_version = version
        if job.active and job.pending:
            pending = self._refits[job.pending]
            targets: list[str] = []
            if request.target_replicas and pending.target_replicas:
                targets = sorted({*pending.target_replicas, *request.target_replicas})
            refit = pending.model_copy(
                update={
                    "version": version,
                    "coalesced": pending.coalesced + 1,
                    "updated_unix": request.now,
                    "target_replicas": targets,
                }
            )
            outcome = TriggerOutcome.COALESCED
        else:
            refit = RefitRecord(
                refit_id=request.new_id,
                job=request.job,
                version=version,
                target_replicas=list(request.target_replicas),
                idempotency_key=key,
                created_unix=request.now,
                updated_unix=request.now,
                phase_started_unix=request.now,
            )
            job.refits.append(refit.refit_id)
            if job.active:
                job.pending = refit.refit_id
            else:
                job.active = refit.refit_id
            outcome = TriggerOutcome.CREATED
        self._refits[refit.refit_id] = refit
        if key:
            job.idempotency[key] = (refit.refit_id, time.time() + request.key_ttl_s)
        return TriggerResult(refit=refit, outcome=outcome)

    async def transition(self, refit: RefitRecord, expected: Iterable[RefitState]) -> None:
        current = self._refits.get(refit.refit_id)
        if current is None:
            raise NotFound(f"refit {refit.refit_id!r} not found", field="refit_id")
        allowed = set(expected)
        if current.state not in allowed:
            raise transition_conflict(refit.refit_id, current.state.value, allowed)
        self._refits[refit.refit_id] = refit
        if not refit.state.terminal:
            return
        job = self._job(refit.job)
        if job.active == refit.refit_id:
            job.active, job.pending = job.pending, ""
        elif job.pending == refit.refit_id:
            job.pending = ""
        if refit.state is RefitState.COMMITTED:
            job.committed_version = max(job.committed_version, refit.version)
        excess = len(job.refits) - REFITS_KEPT_PER_JOB
        if excess > 0:
            for old in job.refits[:excess]:
                if old not in (job.active, job.pending):
                    self._refits.pop(old, None)
                    job.refits.remove(old)
            live = set(job.refits)
            job.idempotency = {k: v for k, v in job.idempotency.items() if v[0] in live}

    async def active_refit(self, job: str) -> RefitRecord | None:
        j = self._jobs.get(job)
        return self._refits.get(j.active) if j is not None and j.active else None

    async def get_refit(self, refit_id: str) -> RefitRecord | None:
        return self._refits.get(refit_id)

    async def list_refits(self, job: str, limit: int) -> list[RefitRecord]:
        j = self._jobs.get(job)
        if j is None:
            return []
        return [self._refits[r] for r in reversed(j.refits[-limit:]) if r in self._refits]
