"""Layouts and planning: the members of a refit arranged into group ranks, their layouts
assembled into a source and a target layout, and plans built once and cached.

Group ranks: trainers first in trainer-rank order (group rank = trainer rank), then the
ranks of every complete generator replica, replicas sorted by id, ranks in order.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from refitplane.coordinator.core.failures import RefitFailed, list_some
from refitplane.coordinator.core.records import MemberRecord, PlanInfo
from refitplane.coordinator.store.base import Store
from refitplane.errors import InvalidArgument, LayoutError
from refitplane.protocol import Backend, Reason, Role
from refitplane.protocol.links import Link, Placement, SameHost, group_transports
from refitplane.reshard.layout import Layout, merge_layouts
from refitplane.reshard.layout_json import dump_layout, parse_layout
from refitplane.reshard.plan import Plan, RankPlan
from refitplane.reshard.planner import build_plan

log = logging.getLogger(__name__)


@dataclass
class ReplicaMembers:
    replica_id: str
    ranks: dict[int, MemberRecord] = field(default_factory=dict)
    sidecar: MemberRecord | None = None

    @property
    def world_size(self) -> int:
        sizes = {m.world_size for m in self.ranks.values()}
        return max(sizes) if sizes else 0

    def problem(self) -> tuple[Reason, str] | None:
        """Why this replica cannot take part in a group (None: it can)."""
        sizes = {m.world_size for m in self.ranks.values()}
        if not self.ranks:
            return Reason.MEMBERS_MISSING, f"replica {self.replica_id!r} has no generator ranks"
        if len(sizes) > 1:
            return (
                Reason.INVALID_TOPOLOGY,
                f"replica {self.replica_id!r}: ranks disagree on world_size ({sorted(sizes)})",
            )
        missing = [str(r) for r in range(self.world_size) if r not in self.ranks]
        if missing:
            return (
                Reason.MEMBERS_MISSING,
                f"replica {self.replica_id!r}: generator rank(s) {list_some(missing)} of "
                f"{self.world_size} not registered",
            )
        no_layout = [m.describe() for m in self.ordered() if not m.layout_digest]
        if no_layout:
            return Reason.LAYOUT_MISSING, f"no layout published by {list_some(no_layout)}"
        return None

    def ordered(self) -> list[MemberRecord]:
        return [self.ranks[r] for r in sorted(self.ranks)]


@dataclass
class Roster:
    """A job's live members arranged for a refit."""

    trainers: list[MemberRecord]
    replicas: dict[str, ReplicaMembers]

    @staticmethod
    def of(members: Iterable[MemberRecord]) -> Roster:
        trainers: list[MemberRecord] = []
        replicas: dict[str, ReplicaMembers] = {}
        for m in members:
            if not m.alive:
                continue
            if m.role is Role.TRAINER:
                trainers.append(m)
            else:
                rep = replicas.setdefault(m.replica_id, ReplicaMembers(m.replica_id))
                if m.role is Role.GENERATOR:
                    rep.ranks[m.rank] = m
                else:
                    rep.sidecar = m
        trainers.sort(key=lambda m: m.rank)
        return Roster(trainers, dict(sorted(replicas.items())))

    def check_trainers(self) -> None:
        if not self.trainers:
            raise RefitFailed(Reason.MEMBERS_MISSING, "no trainer ranks are registered")
        sizes = {m.world_size for m in self.trainers}
        if len(sizes) > 1:
            raise RefitFailed(
                Reason.INVALID_TOPOLOGY, f"trainer ranks disagree on world_size ({sorted(sizes)})"
            )
        world = sizes.pop()
        have = {m.rank for m in self.trainers}
        missing = [str(r) for r in range(world) if r not in have]
        if missing:
            raise RefitFailed(
                Reason.MEMBERS_MISSING,
                f"trainer rank(s) {list_some(missing)} of {world} not registered",
            )
        no_layout = [m.describe() for m in self.trainers if not m.layout_digest]
        if no_layout:
            raise RefitFailed(
                Reason.LAYOUT_MISSING, f"no layout published by {list_some(no_layout)}"
            )

    def complete_replicas(self) -> list[ReplicaMembers]:
        return [r for r in self.replicas.values() if r.problem() is None]

    def targets(self, requested: list[str]) -> list[ReplicaMembers]:
        """The replicas a refit updates: those requested, or every complete replica."""
        if not requested:
            chosen = self.complete_replicas()
            if not chosen:
                problems = [p[1] for r in self.replicas.values() if (p := r.problem())]
                detail = f" ({list_some(problems, 3)})" if problems else ""
                raise RefitFailed(
                    Reason.NO_TARGETS, f"no complete generator replica to update{detail}"
                )
            return chosen
        chosen = []
        for replica_id in requested:
            rep = self.replicas.get(replica_id)
            if rep is None:
                raise RefitFailed(
                    Reason.MEMBERS_MISSING, f"replica {replica_id!r} has no live members"
                )
            problem = rep.problem()
            if problem is not None:
                raise RefitFailed(*problem)
            chosen.append(rep)
        return chosen

    def group_members(self) -> list[MemberRecord]:
        """Every data-plane member of the group, in group-rank order."""
        out = list(self.trainers)
        for rep in self.complete_replicas():
            out.extend(rep.ordered())
        return out

    def backend(self, links: Iterable[Link] = (), same_host: SameHost = "auto") -> Backend:
        """The group's backend for the plan's `links` (group ranks): Gloo on CPUs, CUDA IPC
        when every link stays on one node and IPC serves it, NCCL otherwise
        (`refitplane.protocol.links`)."""
        group = self.group_members()
        devices = {m.device.split(":")[0] for m in group}
        if len(devices) > 1:
            examples = [f"{m.describe()} on {m.device}" for m in group]
            raise RefitFailed(
                Reason.INVALID_TOPOLOGY,
                f"members mix cpu and cuda devices ({list_some(examples, 4)}); one group needs "
                "one backend",
            )
        placements = [Placement(m.device, m.node, m.device_uuid) for m in group]
        try:
            chosen = group_transports(
                placements, links, same_host, names=[m.describe() for m in group]
            )
        except InvalidArgument as exc:
            raise RefitFailed(Reason.INVALID_TOPOLOGY, exc.message) from None
        return chosen.backend


class LayoutCache:
    """Parsed layouts by digest, backed by the store (content-addressed)."""

    def __init__(self, store: Store, *, capacity: int = 8192) -> None:
        self._store = store
        self._layouts: collections.OrderedDict[str, Layout] = collections.OrderedDict()
        self._capacity = capacity

    def _remember(self, layout: Layout) -> None:
        self._layouts[layout.digest] = layout
        self._layouts.move_to_end(layout.digest)
        while len(self._layouts) > self._capacity:
            self._layouts.popitem(last=False)

    def forget(self) -> None:
        """The store lost its layouts: the next put of each one writes it again."""
        self._layouts.clear()

    async def put(self, layout: Layout) -> None:
        if layout.digest not in self._layouts:
            # Off the event loop: a layout's document runs to megabytes.
            doc = await asyncio.to_thread(lambda: json.dumps(dump_layout(layout)))
            await self._store.put_layout(layout.digest, doc)
        self._remember(layout)

    async def get(self, digest: str) -> Layout:
        layout = self._layouts.get(digest)
        if layout is None:
            doc = await self._store.get_layout(digest)
            if doc is None:
                raise RefitFailed(Reason.LAYOUT_MISSING, f"layout {digest[:12]} is not stored")
            layout = parse_layout(json.loads(doc))
            self._remember(layout)
        return layout


@dataclass(frozen=True)
class PlannedRefit:
    plan: Plan
    source_digest: str
    target_digest: str
    # member id → group rank, for every member in the plan
    group_ranks: dict[str, int]
    # group rank → that rank's part, cut once: the same objects go out every step
    rank_plans: dict[int, RankPlan]


# Rank plans remembered per member: as many as an agent keeps by default, so the coordinator
# rarely names a plan the rank has already evicted (it would answer PlanMissing).
HELD_PLANS_PER_MEMBER = 4

PlanKey = tuple[str, int]


class PlanHoldings:
    """Which rank plans (plan digest, group rank) each member holds, as far as the
    coordinator knows: a member acknowledges a plan by reporting Prepared for a PrepareRefit
    that carried or named it. Kept per member id and group epoch, so a re-registered member
    (a new id) and every member of a new epoch get the body again; memory only, so a
    restarted coordinator sends each plan once more. A member that evicted a plan this still
    lists answers PlanMissing, and `forget` drops it."""

    def __init__(self, *, per_member: int = HELD_PLANS_PER_MEMBER) -> None:
        self._per_member = per_member
        self._held: dict[str, tuple[int, collections.OrderedDict[PlanKey, None]]] = {}

    def holds(self, member_id: str, epoch: int, key: PlanKey) -> bool:
        entry = self._held.get(member_id)
        return entry is not None and entry[0] == epoch and key in entry[1]

    def acknowledge(self, member_id: str, epoch: int, key: PlanKey) -> None:
        entry = self._held.get(member_id)
        if entry is None or entry[0] != epoch:
            entry = self._held[member_id] = (epoch, collections.OrderedDict())
        keys = entry[1]
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > self._per_member:
            keys.popitem(last=False)

    def forget(self, member_id: str, key: PlanKey | None = None) -> None:
        """Drop one plan of a member, or (`key` None) everything about it."""
        if key is None:
            self._held.pop(member_id, None)
            return
        entry = self._held.get(member_id)
        if entry is not None:
            entry[1].pop(key, None)


class PlanCache:
    """Plans by their inputs (the members' layout digests at their group ranks, plus hosts),
    so a steady job re-plans never; `PlanInfo` goes to the store."""

    def __init__(
        self, store: Store, layouts: LayoutCache, *, capacity: int = 32, allow_unused: bool = False
    ) -> None:
        self._allow_unused = allow_unused
        self._store = store
        self._layouts = layouts
        self._plans: collections.OrderedDict[str, PlannedRefit] = collections.OrderedDict()
        self._capacity = capacity
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(source: list[tuple[int, MemberRecord]], target: list[tuple[int, MemberRecord]]) -> str:
        h = hashlib.sha256()
        for side, entries in (("S", source), ("T", target)):
            for rank, m in entries:
                h.update(f"{side}|{rank}|{m.rank}|{m.layout_digest}|{m.host}\n".encode())
        return h.hexdigest()

    async def plan(
        self, source: list[tuple[int, MemberRecord]], target: list[tuple[int, MemberRecord]]
    ) -> PlannedRefit:
        key = self._key(source, target)
        hit = self._plans.get(key)
        if hit is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return hit
        self.misses += 1
        src_layouts = [(g, m, await self._layouts.get(m.layout_digest)) for g, m in source]
        dst_layouts = [(g, m, await self._layouts.get(m.layout_digest)) for g, m in target]
        started = time.perf_counter()
        try:
            planned = await asyncio.to_thread(_build, src_layouts, dst_layouts, self._allow_unused)
        except LayoutError as exc:
            raise RefitFailed(exc.reason, exc.message) from None
        log.info(
            "planned %s: %d links, %d bytes in %.3f s",
            planned.plan.digest[:12],
            len(planned.plan.links),
            planned.plan.total_bytes,
            time.perf_counter() - started,
        )
        self._plans[key] = planned
        while len(self._plans) > self._capacity:
            self._plans.popitem(last=False)
        stats = planned.plan.stats()
        await self._store.put_plan_info(
            PlanInfo(
                key=key,
                plan_digest=planned.plan.digest,
                source_digest=planned.source_digest,
                target_digest=planned.target_digest,
                total_bytes=stats.total_bytes,
                num_links=stats.num_links,
                num_tensors=stats.num_tensors,
                created_unix=time.time(),
            )
        )
        return planned


def _build(
    source: list[tuple[int, MemberRecord, Layout]],
    target: list[tuple[int, MemberRecord, Layout]],
    allow_unused: bool = False,
) -> PlannedRefit:
    """Relabel each member's layout to its group rank, merge each side, plan (in a thread)."""
    src = merge_layouts(layout.relabel({m.rank: g}) for g, m, layout in source)
    dst = merge_layouts(layout.relabel({m.rank: g}) for g, m, layout in target)
    hosts = {g: m.host for g, m, _ in (*source, *target) if m.host}
    plan = build_plan(src, dst, hosts=hosts or None, allow_unused=allow_unused)
    ranks = {m.member_id: g for g, m, _ in (*source, *target)}
    return PlannedRefit(
        plan, src.digest, dst.digest, ranks, {g: plan.rank_plan(g) for g in ranks.values()}
    )
