"""Whenever a rank launches work, what it has posted is a prefix of the schedule's order.

A launch (packing, unpacking, checksums; on CUDA also a kernel's first launch, which loads
its module, or any launch once the queue is full) can block the host until the device is
idle. The transfers then in flight finish only if the peers post their counterparts
without waiting for this rank, which holds when this rank's posted messages are a prefix of
the schedule's global order (stage, step, src, dst): every peer posts all it has before it
waits, and what it waits for comes earlier in that shared order. Flushing one channel's
group alone when it filled, and unpacking it before the other channels' older messages were
posted, hung a block-FP8 MoE refit over NCCL at four channels (7cdf1d7).

Two ranks in one process over the loopback transport, bytes moved and checksummed for
real; a recording subclass maps each posted op to its message (a channel posts its
messages in schedule order, so its k-th op is its k-th message) and checks the prefix at
every point where the rank launches or blocks: a packing or side-stream context, a wait,
a poll (a completed group is unpacked next); on the host-ordered path (Gloo's), the
device-ordered one (CUDA's) and that with staging reused on the device. Four channels, small buckets and messages of
uneven sizes over several stages, so the channels' groups fill at different times.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from refitplane.reshard.boxes import full_box
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.schedule import Message, rank_schedule
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.transport.base import Handle, P2POp
from tests.unit.reshard.loopback import LoopbackHub, LoopbackTransport, pair_plans, run_pair

pytestmark = pytest.mark.unit

# Buckets of 256 bytes over four channels; a group is posted once it stages 256 bytes
# (max_inflight_bytes / (2 * channels)), so uneven messages fill channels at uneven steps.
CONFIG = TransferConfig(bucket_bytes=256, max_inflight_bytes=2048, num_channels=4, timeout_s=30)


# Rows (of 8 bf16) of each layer's small tensors, rotated by layer: the layers' messages
# differ in size and count.
ROWS = (3, 5, 2, 7, 4, 6, 1, 5, 3)


def _specs() -> dict[str, TensorSpec]:
    """Eight layers of small tensors (packed together) of uneven sizes, and one tensor per
    layer large enough to travel alone (straight from/to its memory)."""
    specs: list[TensorSpec] = []
    for layer in range(8):
        p = f"model.layers.{layer}"
        for i, rows in enumerate(ROWS[layer % 4 :] + ROWS[: layer % 4]):
            specs.append(TensorSpec.create(f"{p}.block{i}.weight", [rows, 8], "bfloat16"))
        specs.append(TensorSpec.create(f"{p}.norm.weight", [8 + layer], "float32"))
        specs.append(TensorSpec.create(f"{p}.proj.weight", [16, 8], "bfloat16"))
    return {s.name: s for s in specs}


def _value(spec: TensorSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, spec.name)) * 7919 + len(spec.name))
    raw = torch.randint(0, 256, (spec.nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(torch_dtype(spec.dtype)).view(spec.shape)


def _shards(specs: dict[str, TensorSpec], fill: bool) -> LocalShards:
    shards = LocalShards()
    for spec in specs.values():
        tensor = _value(spec).clone()
        if not fill:
            tensor.view(torch.uint8).fill_(0xA5)
        shards.add(spec, full_box(spec.shape), tensor)
    return shards


def _describe(m: Message) -> str:
    return (
        f"message {m.round} from rank {m.src} to rank {m.dst} "
        f"(stage {m.stage}, step {m.step}, channel {m.channel}, first tensor {m.chunks[0].tensor})"
    )


class PostingRecorder(LoopbackTransport):
    """The loopback transport, recording which of the rank's messages each `issue` posts and
    checking, wherever the rank launches work or blocks, that they are a prefix of its
    schedule's order. `path`: "host-ordered" is Gloo's (a group is unpacked after a host
    wait); "device-ordered" is CUDA's: a group is complete when `issue` returns, so unpacking
    and checksums queued `beside` it run after its bytes arrived (a one-way pair cannot
    deadlock on that: the sender never waits); "device-reused" adds NCCL's opt-in staging
    reuse (REFIT_DEVICE_REUSE=1): a posted group gives its staging back at once, and the
    next message taking that space has its channel follow the group (`order_after`, here
    already true)."""

    def __init__(
        self, hub: LoopbackHub, rank: int, plan: RankPlan, config: TransferConfig, path: str
    ) -> None:
        super().__init__(hub, rank, 2, config.num_channels)
        self.device_ordered = path in ("device-ordered", "device-reused")
        self.device_reuse = path == "device-reused"
        self.order = list(rank_schedule(plan, config).messages)
        self.next_on_channel: dict[int, deque[int]] = {}
        for index, m in enumerate(self.order):
            self.next_on_channel.setdefault(m.channel, deque()).append(index)
        self.posted: set[int] = set()
        self.groups: list[tuple[int, list[int]]] = []  # (channel, message indexes)
        self.checks = 0
        self.violations: list[str] = []

    def _check(self, what: str) -> None:
        self.checks += 1
        if len(self.posted) == max(self.posted, default=-1) + 1:
            return
        missing = min(set(range(max(self.posted))) - self.posted)
        later = min(i for i in self.posted if i > missing)
        self.violations.append(
            f"{what} with {_describe(self.order[later])} posted but not "
            f"{_describe(self.order[missing])}, which precedes it"
        )

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        if len(self.posted) < len(self.order):
            queue = self.next_on_channel.get(channel, deque())
            if len(queue) < len(ops):
                raise AssertionError(
                    f"rank {self.rank}: more ops on channel {channel} than messages"
                )
            members = [queue.popleft() for _ in ops]
            for index, op in zip(members, ops, strict=True):
                m = self.order[index]
                assert (op.send, op.peer) == (
                    (True, m.dst) if m.src == self.rank else (False, m.src)
                ), (self.rank, channel, index)
            self.posted.update(members)
            self.groups.append((channel, members))
        # else: the checksum exchange after the last message (no message of the schedule).
        handle = super().issue(channel, ops, deadline)
        if self.device_ordered:
            LoopbackTransport.wait(self, handle, deadline)
        return handle

    def channel_context(self, channel: int) -> contextlib.AbstractContextManager[Any]:
        self._check(f"packs on channel {channel}")
        return super().channel_context(channel)

    def beside(
        self, channel: int, *, after_transfer: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        self._check(f"queues work beside channel {channel}")
        return super().beside(channel, after_transfer=after_transfer)

    def poll(self, handle: Handle) -> bool:
        done = super().poll(handle)
        if done:
            # The rank completes the group next: its unpacking and checksums.
            self._check(f"completes a group of channel {handle.channel}")
        return done

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        self._check(f"waits for a group of channel {handle.channel}")
        super().wait(handle, deadline, cancel)


@pytest.mark.parametrize("path", ["host-ordered", "device-ordered", "device-reused"])
def test_posted_messages_are_a_prefix_of_the_schedule_whenever_a_rank_launches_work(
    path: str,
) -> None:
    specs = _specs()
    plans = pair_plans(specs)
    hub = LoopbackHub()
    recorders = [PostingRecorder(hub, rank, plans[rank], CONFIG, path) for rank in (0, 1)]
    receiver = _shards(specs, fill=False)
    errors = run_pair(hub, recorders, plans, (_shards(specs, fill=True), receiver), CONFIG)
    assert not errors, errors
    for name, spec in specs.items():
        got = receiver.view(name, full_box(spec.shape)).view(torch.uint8)
        assert torch.equal(got, _value(spec).view(torch.uint8)), name
    for rec in recorders:
        # The run is one that can break the order: every message posted, in several groups
        # per channel on every channel, and checked at many points.
        assert rec.posted == set(range(len(rec.order))), rec.rank
        per_channel = [sum(c == ch for c, _ in rec.groups) for ch in range(CONFIG.num_channels)]
        assert min(per_channel) >= 3, (rec.rank, per_channel)
        assert rec.checks >= len(rec.groups), rec.rank
    broken = [rec for rec in recorders if rec.violations]
    assert not broken, "\n".join(
        f"rank {rec.rank}: {len(rec.violations)} of {rec.checks} points out of order, first: "
        + rec.violations[0]
        for rec in broken
    )
