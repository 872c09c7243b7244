"""What generator ranks report holding outside a refit (`RenewLease.held`), and what a
job's records make of it: a replica a coordinator restart left unverified adopts the
version its ranks hold, and a rank that holds less than its record says (vLLM's sleep at
level 2 discarded its weights) has its record lowered to what it holds. Only a commit
raises a version; a refit targeting the replica decides it instead of these reports.
"""

from __future__ import annotations

import logging

from refitplane.coordinator.core.context import DriverContext
from refitplane.coordinator.core.records import MemberRecord
from refitplane.coordinator.core.replicas import Held, ReplicaHealth
from refitplane.coordinator.core.run import RefitRun
from refitplane.protocol import Role

log = logging.getLogger(__name__)


class HeldVersions:
    """One job's view of what its generator ranks hold between refits."""

    def __init__(self, job: str, ctx: DriverContext, replicas: ReplicaHealth) -> None:
        self._job = job
        self._ctx = ctx
        self._replicas = replicas
        # Generator member id → (version, serving) it reported, for unverified replicas.
        self._held: dict[str, Held] = {}
        # Generator member id → the lower version it reported holding once (`_lower_to_held`).
        self._below: dict[str, int] = {}

    async def report(
        self, member: MemberRecord, version: int, serving: bool, run: RefitRun | None
    ) -> None:
        """A generator rank reported what it holds (RenewLease.held) while `run` is in
        flight (None: no refit). Settles a replica a coordinator restart left unverified
        (the kill -9 rule, `ReplicaHealth.adopt`); a refit targeting the replica decides it
        instead."""
        replica = member.replica_id
        if run is not None and replica in run.cast.replica_ranks:
            self._below.pop(member.member_id, None)
            return
        if not self._replicas.unverified(replica):
            await self._lower_to_held(member, version)
            return
        self._held[member.member_id] = (version, serving)
        ranks = [
            m
            for m in self._ctx.membership.of_job(self._job)
            if m.alive and m.role is Role.GENERATOR and m.replica_id == replica
        ]
        adopted = await self._replicas.adopt(replica, ranks, self._held)
        for m in ranks:
            if adopted and m.version != adopted:
                await self._ctx.membership.update(m.model_copy(update={"version": adopted}))
            if not self._replicas.unverified(replica):
                self._held.pop(m.member_id, None)
        if adopted:
            log.info("replica %r adopted version %d, which its ranks hold", replica, adopted)

    async def _lower_to_held(self, member: MemberRecord, version: int) -> None:
        """A rank that holds less than its record says lost weights outside any refit (vLLM's
        sleep at level 2 discards them; the engine then holds version 0): the record takes
        what the rank holds, so its replica is not shown at a version it lacks and the next
        refit is a full one (no delta base). On the second report in a row: one renewal,
        read before a finish and answered after the commit, can be stale; the next one is
        read after it. Never raised here: only a commit raises a version."""
        if version >= member.version:
            self._below.pop(member.member_id, None)
            return
        if self._below.get(member.member_id) != version:
            self._below[member.member_id] = version
            return
        del self._below[member.member_id]
        await self._ctx.membership.update(member.model_copy(update={"version": version}))
        log.warning(
            "%s holds version %d, not %d (weights discarded outside a refit)",
            member.describe(),
            version,
            member.version,
        )
