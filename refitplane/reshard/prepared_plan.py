"""A rank plan made ready to run (`PreparedPlan`): its schedule, every message's resolved
local memory, checksum launch tables, staged buckets and staging ring size, kept by the
executor while plan and shards stay the same.

The ring is sized to what the plan can use (`staging_room`): the bytes of its packed
messages (those not moved straight from/to their memory), never more than
`max_inflight_bytes`, and for a receiver that stages its weights a bucket at a time never more
than what the staged arena (its largest bucket) leaves of that budget: refitplane's own
staging on a rank, ring and arena, stays within `max_inflight_bytes`. A rank whose messages
all go direct reserves no ring. Whether a staged message goes direct depends on where its
bucket lays its tensors out, which is known before any arena exists (`StagedShards.probing`).
Where the largest bucket plus the largest packed message do not fit the budget, the refit is
refused before any byte moves, naming the bucket and the budget it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refitplane.errors import InvalidArgument
from refitplane.reshard.checksum import LaunchTables
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.message_io import MessageIO, resolve_message
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.schedule import Message, RankSchedule
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.staged import StagedBucket, StagedShards
from refitplane.reshard.staging import ring_bytes_for

Steps = tuple[tuple[tuple[Message, MessageIO | None], ...], ...]


@dataclass
class PreparedPlan:
    """A rank plan's schedule and resolved views, kept while plan and shards stay the same
    (refits of one job repeat the same plan: resolving hundreds of views costs ms), also
    across registries rebuilt over the same memory."""

    plan: RankPlan
    shards: LocalShards
    shards_version: int
    fingerprint: tuple[tuple[object, ...], ...]
    schedule: RankSchedule
    # The schedule's steps with each message's resolved local memory (None: a staged
    # message, resolved when its bucket opens).
    steps: Steps
    # Reserved checksum launch tables (verified runs on CUDA), one entry per message.
    tables: LaunchTables | None = None
    # Distinct tensors received, counted once per plan rather than per refit.
    tensors_received: int = 0
    # Staged receivers: the buckets, and the steps each one spans.
    buckets: tuple[StagedBucket, ...] = ()
    bucket_steps: tuple[range, ...] = ()
    # The staging ring its runs reserve (`staging_room`), and the budget it could have had:
    # what the posting loop paces its groups by.
    ring_bytes: int = 0
    ring_room: int = 0

    def serves(self, plan: RankPlan, shards: LocalShards) -> bool:
        same_plan = plan is self.plan or (
            bool(plan.plan_digest)
            and plan.plan_digest == self.plan.plan_digest
            and plan.rank == self.plan.rank
        )
        if not same_plan:
            return False
        if shards is self.shards and shards.version == self.shards_version:
            return True
        if isinstance(shards, StagedShards):
            return False  # its buckets follow its own settings, whatever its memory
        # A new registry over the same memory (the cached views keep the old memory alive,
        # so equal addresses mean the same memory).
        return shards.fingerprint() == self.fingerprint


def bucket_steps(schedule: RankSchedule, buckets: list[StagedBucket]) -> list[range]:
    """For each bucket, the steps from its first stage's first to its last stage's last."""
    bucket_of = {stage: b.index for b in buckets for stage in b.stages}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, step in enumerate(schedule.steps):
        b = bucket_of.get(step[0].stage)
        if b is not None:
            first.setdefault(b, i)
            last[b] = i
    return [range(first[b.index], last[b.index] + 1) for b in buckets]


def packed_sizes(
    plan: RankPlan,
    steps: Steps,
    shards: LocalShards,
    buckets: Sequence[StagedBucket],
    spans: Sequence[range],
) -> list[int]:
    """Bytes of every message this rank packs or unpacks through the staging ring: those
    whose local memory is not one span. A staged message is resolved against its bucket's
    layout on the meta device (`StagedShards.probing`); one in no bucket (refused when it is
    reached) counts as packed."""
    sizes = [m.nbytes for step in steps for m, io in step if io is not None and io.direct is None]
    probed: set[int] = set()
    if isinstance(shards, StagedShards):
        for bucket, span in zip(buckets, spans, strict=True):
            with shards.probing(bucket):
                for i in span:
                    probed.add(i)
                    for m, io in steps[i]:
                        if io is None and resolve_message(m, shards, plan.specs).direct is None:
                            sizes.append(m.nbytes)
    sizes += [
        m.nbytes for i, step in enumerate(steps) if i not in probed for m, io in step if io is None
    ]
    return sizes


def staging_room(
    rank: int, sizes: Sequence[int], config: TransferConfig, arena: StagedBucket | None
) -> tuple[int, int]:
    """(ring bytes, room): the ring a run of this plan reserves, and the budget left for it
    (`max_inflight_bytes` less the staged `arena`, the largest bucket of a layerwise staged
    receiver; None where there is none, or where the rank stages its whole share at once by
    choice, the "staged" receive mode, whose arena is that share and outside the budget).
    Raises InvalidArgument, before any byte moves, where the arena and the largest packed
    message do not fit the budget together: staging more would exceed it silently."""
    budget = config.max_inflight_bytes
    held = arena.nbytes if arena is not None else 0
    room = budget - held
    largest = max(sizes, default=0)
    if largest > room:  # sizes are never negative: a negative room fails here too
        staged = f"{arena.describe()}, staged as one" if arena is not None else "no staged arena"
        ring = f", plus its largest packed message ({largest} bytes) in the ring" if largest else ""
        raise InvalidArgument(
            f"rank {rank}: max_inflight_bytes ({budget} bytes) cannot hold this rank's staging "
            f"({staged}{ring}): staging ring and staged arena share the budget, so set "
            f"REFIT_MAX_INFLIGHT_BYTES to at least {held + largest} bytes",
            field="max_inflight_bytes",
        )
    return min(ring_bytes_for(sizes), room), room
