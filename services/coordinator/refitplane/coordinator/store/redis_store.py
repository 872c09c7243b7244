"""The Redis store (redis-py asyncio). Multi-key steps are the Lua scripts in `lua/`, so
each is atomic on the server; single-key writes are plain commands. Key schema (prefix
`refit:` by default; docs/coordinator.md has the full table):

    jobs                         SET    job names
    job:{job}                    HASH   active, pending, last_version, committed_version, seq
    job:{job}:members            HASH   "{role}/{replica}/{rank}" → member id
    job:{job}:refits             ZSET   refit id, scored by creation sequence
    job:{job}:group              STRING GroupRecord JSON (current epoch)
    job:{job}:replicas           HASH   replica id → ReplicaRecord JSON
    member:{id}                  STRING MemberRecord JSON
    refit:{id}                   STRING RefitRecord JSON
    idem:{job}:{key}             STRING refit id (expires after the key TTL)
    incarnation                  STRING sentinel written at start (gone: the store lost state)
    layout:{digest}              STRING layout JSON (content-addressed; expires after the
                                        layout TTL unless live members refresh it)
    plan:{key}                   STRING PlanInfo JSON

Single-node Redis (or a primary with replicas): the scripts derive key names from the prefix,
which Redis Cluster does not allow.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

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
    StoreStateLost,
    stale_version_error,
    transition_conflict,
    version_too_large_error,
)
from refitplane.errors import NotFound, Unavailable
from refitplane.protocol import RefitState

_SCRIPTS = (
    "register",
    "unregister",
    "save_member",
    "trigger",
    "transition",
    "active",
    "raise_versions",
    "forget",
)


def _lua(name: str) -> str:
    """A checked-in script (package data: `store/lua/*.lua`)."""
    return resources.files("refitplane.coordinator.store").joinpath(f"lua/{name}.lua").read_text()


class RedisStore(Store):
    kind = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "refit:",
        timeout_s: float = 5.0,
        max_connections: int = 128,
        pool_timeout_s: float = 10.0,
        layout_ttl_s: float = 7 * 86400.0,
    ) -> None:
        self._prefix = prefix
        self._layout_ttl_ms = max(1, int(layout_ttl_s * 1000))
        # A blocking pool: under a burst a caller waits for a connection (up to
        # pool_timeout_s) instead of failing at once with "Too many connections", which the
        # API would have reported as a store outage (503) while Redis was healthy.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=30,
        )
        self._redis: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self._scripts = {name: self._redis.register_script(_lua(name)) for name in _SCRIPTS}
        # The sentinel this coordinator claimed (triggers check the store still holds it).
        self._incarnation = ""

    @asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        # Connection trouble becomes a domain error (UNAVAILABLE / 503); the message never
        # carries the URL, which may hold a password.
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"state store unreachable ({type(exc).__name__})") from None

    async def _run(self, script: str, *args: Any) -> Any:
        async with self._guard():
            return await self._scripts[script](keys=[], args=[self._prefix, *args])

    def _k(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    async def ping(self) -> None:
        async with self._guard():
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    # --- lost state ------------------------------------------------------------------------

    async def claim_incarnation(self) -> str:
        async with self._guard():
            key = self._k("incarnation")
            await self._redis.set(key, uuid.uuid4().hex, nx=True)
            self._incarnation = str(await self._redis.get(key) or "")
        return self._incarnation

    async def incarnation(self) -> str | None:
        async with self._guard():
            value = await self._redis.get(self._k("incarnation"))
        return None if value is None else str(value)

    async def raise_versions(self, job: str, *, last_version: int, committed_version: int) -> None:
        await self._run("raise_versions", job, str(last_version), str(committed_version))

    async def restore_refit(self, refit: RefitRecord) -> None:
        jobkey = self._k("job", refit.job)
        async with self._guard():
            seq = await self._redis.hincrby(jobkey, "seq", 1)
        async with self._guard(), self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("refit", refit.refit_id), refit.model_dump_json())
            pipe.zadd(self._k("job", refit.job, "refits"), {refit.refit_id: seq})
            pipe.hset(jobkey, "active", refit.refit_id)
            pipe.sadd(self._k("jobs"), refit.job)
            await pipe.execute()

    async def restore_idempotency_key(
        self, job: str, key: str, refit: RefitRecord, ttl_s: int
    ) -> None:
        async with self._guard():
            seq = await self._redis.hincrby(self._k("job", job), "seq", 1)
        async with self._guard(), self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("refit", refit.refit_id), refit.model_dump_json(), nx=True)
            pipe.zadd(self._k("job", job, "refits"), {refit.refit_id: seq}, nx=True)
            pipe.set(self._k("idem", job, key), refit.refit_id, ex=max(1, ttl_s), nx=True)
            await pipe.execute()

    # --- members -------------------------------------------------------------------------

    async def register_member(self, member: MemberRecord) -> str | None:
        old = await self._run(
            "register",
            member.job,
            member.key,
            member.member_id,
            member.model_dump_json(),
            str(member.version),
        )
        return str(old) or None

    async def save_member(self, member: MemberRecord) -> None:
        await self._run(
            "save_member", member.job, member.key, member.member_id, member.model_dump_json()
        )

    async def delete_member(self, member: MemberRecord) -> None:
        await self._run("unregister", member.job, member.key, member.member_id)

    async def load_members(self) -> list[MemberRecord]:
        async with self._guard():
            ids: list[str] = []
            for job in await self._redis.smembers(self._k("jobs")):
                ids.extend(map(str, await self._redis.hvals(self._k("job", str(job), "members"))))
            if not ids:
                return []
            docs = await self._redis.mget([self._k("member", i) for i in ids])
        return [MemberRecord.model_validate_json(d) for d in docs if d]

    # --- layouts and plans ---------------------------------------------------------------

    async def put_layout(self, digest: str, doc: str) -> None:
        async with self._guard():
            key = self._k("layout", digest)
            if not await self._redis.set(key, doc, nx=True, px=self._layout_ttl_ms):
                await self._redis.pexpire(key, self._layout_ttl_ms)

    async def get_layout(self, digest: str) -> str | None:
        async with self._guard():
            doc = await self._redis.getex(self._k("layout", digest), px=self._layout_ttl_ms)
        return None if doc is None else str(doc)

    async def touch_layouts(self, digests: Iterable[str]) -> None:
        keys = [self._k("layout", d) for d in digests]
        if keys:
            async with self._guard(), self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.pexpire(key, self._layout_ttl_ms)
                await pipe.execute()

    async def put_plan_info(self, info: PlanInfo) -> None:
        async with self._guard():
            await self._redis.set(self._k("plan", info.key), info.model_dump_json())

    async def get_plan_info(self, key: str) -> PlanInfo | None:
        async with self._guard():
            doc = await self._redis.get(self._k("plan", key))
        return PlanInfo.model_validate_json(doc) if doc else None

    # --- jobs ----------------------------------------------------------------------------

    async def jobs(self) -> list[str]:
        async with self._guard():
            return sorted(str(j) for j in await self._redis.smembers(self._k("jobs")))

    async def forget_job(self, job: str) -> bool:
        return bool(await self._run("forget", job))

    async def load_job(self, job: str) -> JobRecord:
        async with self._guard(), self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._k("job", job))
            pipe.get(self._k("job", job, "group"))
            pipe.hgetall(self._k("job", job, "replicas"))
            fields, group_doc, replica_docs = await pipe.execute()
        return JobRecord(
            job=job,
            active=fields.get("active", ""),
            pending=fields.get("pending", ""),
            last_version=int(fields.get("last_version", 0)),
            committed_version=int(fields.get("committed_version", 0)),
            group=GroupRecord.model_validate_json(group_doc) if group_doc else GroupRecord(job=job),
            replicas={
                rid: ReplicaRecord.model_validate_json(doc) for rid, doc in replica_docs.items()
            },
        )

    async def save_group(self, group: GroupRecord) -> None:
        async with self._guard():
            await self._redis.set(self._k("job", group.job, "group"), group.model_dump_json())

    async def save_replicas(self, job: str, replicas: Iterable[ReplicaRecord]) -> None:
        mapping = {r.replica_id: r.model_dump_json() for r in replicas}
        if mapping:
            async with self._guard():
                # (redis-py's mapping type is invariant in its keys; these are plain strings)
                await self._redis.hset(
                    self._k("job", job, "replicas"), mapping=cast("dict[Any, Any]", mapping)
                )

    # --- refits --------------------------------------------------------------------------

    async def trigger(self, request: TriggerRequest) -> TriggerResult:
        outcome, payload = await self._run(
            "trigger",
            request.job,
            str(request.version),
            json.dumps(list(request.target_replicas)),
            request.idempotency_key,
            repr(request.now),
            request.new_id,
            str(request.key_ttl_s),
            str(MAX_VERSION),
            self._incarnation,
        )
        if outcome == "lost":
            raise StoreStateLost("the state store lost its state; the coordinator re-seeds it")
        if outcome == "stale":
            raise stale_version_error(request.version, int(payload))
        if outcome == "too_large":
            raise version_too_large_error(request.version)
        return TriggerResult(
            refit=RefitRecord.model_validate_json(payload), outcome=TriggerOutcome(outcome)
        )

    async def transition(self, refit: RefitRecord, expected: Iterable[RefitState]) -> None:
        allowed = list(expected)
        result, state = await self._run(
            "transition",
            refit.job,
            refit.refit_id,
            ",".join(s.value for s in allowed),
            refit.model_dump_json(),
            "1" if refit.state.terminal else "0",
            str(refit.version if refit.state is RefitState.COMMITTED else 0),
            str(REFITS_KEPT_PER_JOB),
            self._incarnation,
        )
        if result == "lost":
            # A driver's write that finds its record wiped before the store check noticed:
            # the loss, not an unknown refit (which would end the run without a record).
            raise StoreStateLost(
                f"refit {refit.refit_id!r}: the state store lost its state; the coordinator "
                "re-seeds it"
            )
        if result == "missing":
            raise NotFound(f"refit {refit.refit_id!r} not found", field="refit_id")
        if result == "conflict":
            raise transition_conflict(refit.refit_id, state, allowed)

    async def active_refit(self, job: str) -> RefitRecord | None:
        doc = await self._run("active", job)
        return RefitRecord.model_validate_json(doc) if doc else None

    async def get_refit(self, refit_id: str) -> RefitRecord | None:
        async with self._guard():
            doc = await self._redis.get(self._k("refit", refit_id))
        return RefitRecord.model_validate_json(doc) if doc else None

    async def list_refits(self, job: str, limit: int) -> list[RefitRecord]:
        async with self._guard():
            ids = await self._redis.zrevrange(self._k("job", job, "refits"), 0, limit - 1)
            if not ids:
                return []
            docs = await self._redis.mget([self._k("refit", str(i)) for i in ids])
        return [RefitRecord.model_validate_json(d) for d in docs if d]
