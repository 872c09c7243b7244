"""How large the posting loop lets a group grow (`op_group.group_limit`).

Bytes move only once their group is posted, and a receiver sums a group only once all of it
arrived: the first group is a wait before the first byte moves, the last group's sums a
wait after the last byte arrived. So groups start small, grow to GROUP_BUCKETS buckets, and
shrink again toward the end of the schedule, down to one message. Checked on the rule itself
and on two ranks moving real bytes over the in-process loopback transport, recording the
bytes each post carries; REFIT_GROUP_TAPER=0 keeps every group at the full size.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from refitplane.reshard import op_group
from refitplane.reshard.boxes import full_box
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.op_group import GROUP_BUCKETS, group_limit
from refitplane.reshard.schedule import rank_schedule
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import Handle, P2POp
from tests.unit.reshard.loopback import (
    LoopbackHub,
    LoopbackTransport,
    bf16_pair_shards,
    pair_plans,
    run_pair,
)

pytestmark = pytest.mark.unit

BUCKET = 4096
# Every tensor travels alone (half a bucket or more), straight from/to its memory: groups
# are bounded by their bytes only, never by staging.
CONFIG = TransferConfig(
    bucket_bytes=BUCKET, max_inflight_bytes=64 * BUCKET, num_channels=2, timeout_s=30
)
LAYERS = 24


def test_groups_start_at_a_quarter_bucket_and_double_up_to_the_full_size() -> None:
    far = 1 << 40  # the end of the schedule far away
    limits = [group_limit(posted, far, BUCKET, 4, taper=1) for posted in range(6)]
    assert limits == [BUCKET // 4, BUCKET // 2, BUCKET, 2 * BUCKET, 4 * BUCKET, 4 * BUCKET]
    assert GROUP_BUCKETS == 4
    assert group_limit(1000, far, BUCKET, 4, taper=1) == GROUP_BUCKETS * BUCKET


def test_near_the_end_a_group_is_at_most_half_of_what_remains_per_channel() -> None:
    assert group_limit(50, 8 * BUCKET, BUCKET, 4, taper=1) == BUCKET
    assert group_limit(50, 8 * BUCKET, BUCKET, 2, taper=1) == 2 * BUCKET
    # Nothing after this step: every message is posted as soon as it is added.
    assert group_limit(50, 0, BUCKET, 4, taper=1) == 1
    # Off: the full size from the first post to the last.
    for posted, after in ((0, 1 << 40), (50, 0), (3, BUCKET)):
        assert group_limit(posted, after, BUCKET, 4, taper=0) == GROUP_BUCKETS * BUCKET


def _specs() -> dict[str, TensorSpec]:
    """Per layer, two 4 KiB projections and one 2 KiB: 10 KiB per layer, 240 KiB in all."""
    specs = []
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        specs += [
            TensorSpec.create(f"{p}.mlp.up_proj.weight", [32, 64], "bfloat16"),
            TensorSpec.create(f"{p}.mlp.down_proj.weight", [64, 32], "bfloat16"),
            TensorSpec.create(f"{p}.self_attn.o_proj.weight", [32, 32], "bfloat16"),
        ]
    return {s.name: s for s in specs}


class PostRecorder(LoopbackTransport):
    """The loopback transport, recording the bytes of each post of the schedule's messages
    (the checksum exchange after the last one is not recorded)."""

    def __init__(self, hub: LoopbackHub, rank: int, messages: int) -> None:
        super().__init__(hub, rank, 2, CONFIG.num_channels)
        self.left = messages
        self.posts: list[list[int]] = []  # bytes of each message of each post

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        if self.left > 0:
            self.posts.append([op.buffer.numel() * op.buffer.element_size() for op in ops])
            self.left -= len(ops)
        return super().issue(channel, ops, deadline)


def _run(specs: dict[str, TensorSpec]) -> list[list[list[int]]]:
    """Both ranks' posts of one refit, after checking that every byte arrived."""
    plans = pair_plans(specs)
    hub = LoopbackHub()
    counts = [sum(1 for _ in rank_schedule(plans[r], CONFIG).messages) for r in (0, 1)]
    recorders = [PostRecorder(hub, r, counts[r]) for r in (0, 1)]
    values, source, target = bf16_pair_shards(specs)
    reports: dict[int, TransferReport] = {}
    errors = run_pair(hub, recorders, plans, (source, target), CONFIG, reports)
    assert not errors, errors
    for report in reports.values():
        # Each rank's first group went out before its last, and both within its run.
        assert 0 < report.first_post_seconds <= report.posted_seconds <= report.seconds
        # Its posting call is part of that wait, the communicator's settling part of the call.
        assert 0 < report.first_post_call_seconds <= report.first_post_seconds
        assert 0 <= report.first_post_settle_seconds <= report.first_post_call_seconds
    for name, spec in specs.items():
        assert torch.equal(target.view(name, full_box(spec.shape)), values[name]), name
    return [rec.posts for rec in recorders]


def test_a_refit_posts_small_groups_first_and_last_and_full_ones_between() -> None:
    specs = _specs()
    for posts in _run(specs):
        sizes = [sum(p) for p in posts]
        assert sum(sizes) == sum(s.nbytes for s in specs.values())
        # The first post carries one message: bytes move after one `add`, not after a
        # group's worth of them.
        assert len(posts[0]) == 1, posts[:3]
        # The last post too: the receiver's last sums cover one message.
        assert len(posts[-1]) == 1, posts[-3:]
        # Between, groups reach the full size (every channel's group posts together: one
        # channel's share of a flush reaches GROUP_BUCKETS buckets).
        assert max(sizes) >= GROUP_BUCKETS * BUCKET, sizes


def test_without_the_taper_every_group_is_the_full_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(op_group, "GROUP_TAPER", 0)
    specs = _specs()
    for posts in _run(specs):
        # Posts come in flushes of both channels: all but the last flush hold at least a
        # full group on one channel, so the first post holds several messages.
        assert len(posts[0]) > 1, posts[:3]
        assert (
            len(posts) < 2 * sum(s.nbytes for s in specs.values()) // (GROUP_BUCKETS * BUCKET) + 4
        )
