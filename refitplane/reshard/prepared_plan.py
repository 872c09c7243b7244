"""A rank plan made ready to run (`PreparedPlan`): its schedule, every message's resolved
local memory, checksum launch tables and staged buckets, kept by the executor while plan and
shards stay the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from refitplane.reshard.checksum import LaunchTables
from refitplane.reshard.message_io import MessageIO
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.schedule import Message, RankSchedule
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.staged import StagedBucket, StagedShards

if TYPE_CHECKING:
    pass


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
    steps: tuple[tuple[tuple[Message, MessageIO | None], ...], ...]
    # Reserved checksum launch tables (verified runs on CUDA), one entry per message.
    tables: LaunchTables | None = None
    # Distinct tensors received, counted once per plan rather than per refit.
    tensors_received: int = 0
    # Staged receivers: the buckets, and the steps each one spans.
    buckets: tuple[StagedBucket, ...] = ()
    bucket_steps: tuple[range, ...] = ()

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
