"""Device-ordered staging reuse never makes a message wait for a later one.

Over NCCL a posted group gives its staging slices back at once, and the next message that
takes that space has its channel wait, on the device, for the group that last used it
(`Executor._follow`, `Transport.order_after`). That cannot deadlock two ranks only if every
such wait points from a message to groups of messages *before* it in the schedule's global
order (which every rank shares), and if no message posted beside the waiting one on its
channel came before it (the channel's pending group is posted first). GPUs are where this
runs; here a recording transport stands in for NCCL's streams (it completes a group only
when the executor waits for it, never by polling, so staging is reused as early as the
executor allows) and checks both conditions on every rank of every scenario, four channels,
a ring of four buckets (reused by every rank that stages more than that).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.planner import build_plan
from refitplane.reshard.transport.base import Handle, P2POp, Transport
from tests.integration.reshard.scenarios import SCENARIOS, make_shards


class RecordingTransport(Transport):
    """Records posted groups (channel, op count) and device-side waits; moves no bytes."""

    device_ordered = True
    device_reuse = True

    def __init__(self, rank: int, world_size: int, num_channels: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.num_channels = num_channels
        self.device = torch.device("cpu")
        self.groups: list[tuple[int, int]] = []  # handle id → (channel, ops)
        # (channel, followed handle ids, groups posted so far)
        self.follows: list[tuple[int, list[int], int]] = []

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        self.groups.append((channel, len(ops)))
        return Handle(channel, len(self.groups) - 1)

    def order_after(self, channel: int, handles: Sequence[Handle]) -> None:
        self.follows.append((channel, [h.payload for h in handles], len(self.groups)))

    def poll(self, handle: Handle) -> bool:
        return False

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        return None

    def abort(self) -> None:
        return None

    def close(self) -> None:
        return None


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_device_side_wait_points_to_earlier_messages(scenario: str) -> None:
    sc = SCENARIOS[scenario]()
    plan = build_plan(sc.source, sc.target)
    config = TransferConfig(
        bucket_bytes=256, max_inflight_bytes=1024, num_channels=4, verify_checksums=False
    )
    for rank in range(sc.world_size):
        rank_plan = plan.rank_plan(rank)
        if not rank_plan.sends and not rank_plan.recvs:
            continue
        shards = make_shards(
            sc.source if rank in sc.source.ranks() else sc.target,
            rank,
            fill=rank in sc.source.ranks(),
        )
        transport = RecordingTransport(rank, sc.world_size, config.num_channels)
        executor = Executor(transport, config)
        executor.run(rank_plan, shards)
        assert executor._prepared is not None
        # The schedule's global order of this rank's messages; each channel posts its own
        # in that order, so the k-th op posted on a channel is its k-th message.
        order = [m for step in executor._prepared.steps for m, _ in step]
        staged = sum(
            m.nbytes
            for step in executor._prepared.steps
            for m, io in step
            if io and io.direct is None
        )
        per_channel: dict[int, list[int]] = {}
        for index, m in enumerate(order):
            per_channel.setdefault(m.channel, []).append(index)
        members: list[list[int]] = []
        posted = dict.fromkeys(per_channel, 0)
        for channel, ops in transport.groups:
            members.append(per_channel[channel][posted[channel] : posted[channel] + ops])
            posted[channel] += ops
        assert posted == {c: len(ms) for c, ms in per_channel.items()}, (rank, posted)
        for channel, followed, groups_before in transport.follows:
            # The waiting message is the first one its channel posts after the wait.
            later = [
                g
                for g, (c, _) in enumerate(transport.groups)
                if c == channel and g >= groups_before
            ]
            assert later, (rank, channel, "a wait with nothing posted after it")
            waiting = members[later[0]][0]
            before = [
                g for g, (c, _) in enumerate(transport.groups[:groups_before]) if c == channel
            ]
            posted_before = sum(len(members[g]) for g in before)
            assert per_channel[channel][posted_before] == waiting, (rank, channel)
            for g in followed:
                assert g < groups_before
                assert max(members[g]) < waiting, (rank, channel, members[g], waiting)
        if staged > config.max_inflight_bytes:  # the ring had to be reused
            assert transport.follows, (rank, staged)
