"""One channel's batch of sends and receives (`OpGroup`): the ops posted together, the
copies into and out of staging around them, and the checksums after; and how large a batch
grows before it is posted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refitplane.reshard.chunk_copy import ChunkTable
from refitplane.reshard.delta_exchange import DeltaMessage
from refitplane.reshard.message_io import StridedChunk
from refitplane.reshard.schedule import Message
from refitplane.reshard.transport.base import Handle, P2POp
from refitplane.reshard.triton_load import launch_setting


@dataclass
class OpGroup:
    """Ops of one channel waiting to be posted together, or posted and in flight."""

    ops: list[P2POp] = field(default_factory=list)
    # Staged chunks with contiguous local memory, copied in one `_foreach_copy_` per group
    # and direction: into staging before the sends are posted (`pack_*`), out of it after
    # the transfer (`unpack_*`). Strided chunks are copied alone; the receiver's wait in
    # `unpack_strided` as (staging part, chunk).
    pack_dst: list[torch.Tensor] = field(default_factory=list)
    pack_src: list[torch.Tensor] = field(default_factory=list)
    unpack_dst: list[torch.Tensor] = field(default_factory=list)
    unpack_src: list[torch.Tensor] = field(default_factory=list)
    unpack_strided: list[tuple[torch.Tensor, StridedChunk]] = field(default_factory=list)
    # Staged messages with a chunk table (`chunk_copy.py`): one launch each, packing into
    # (`pack_tables`) or unpacking from (`unpack_tables`) the message's staging slice.
    # A pack of whole words may add the message's checksum sums into its row as it copies.
    pack_tables: list[tuple[ChunkTable, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=list
    )
    unpack_tables: list[tuple[ChunkTable, torch.Tensor]] = field(default_factory=list)
    # Received deltas, applied in place to (message image, delta) before unpacking.
    delta_apply: list[tuple[torch.Tensor, DeltaMessage]] = field(default_factory=list)
    # After the transfer (and unpacking): one checksum launch for every message buffer of
    # the group into its row (`sum_rows[i]` for `sum_bufs[i]`).
    sum_bufs: list[torch.Tensor] = field(default_factory=list)
    sum_rows: list[torch.Tensor] = field(default_factory=list)
    slices: list[int] = field(default_factory=list)
    nbytes: int = 0
    payload: int = 0  # tensor bytes (nbytes less packing alignment)
    staged: int = 0
    handle: Handle | None = None
    post: Callable[[], None] | None = None
    # The group's messages, for error messages.
    messages: list[Message] = field(default_factory=list)

    def describe(self, rank: int) -> str:
        sends = sorted({m.dst for m in self.messages if m.src == rank})
        recvs = sorted({m.src for m in self.messages if m.dst == rank})
        rounds = [m.round for m in self.messages]
        parts = [f"{len(self.messages)} message(s), rounds {min(rounds)}-{max(rounds)}"]
        if sends:
            parts.append(f"sends to rank(s) {sends}")
        if recvs:
            parts.append(f"receives from rank(s) {recvs}")
        parts.append(f"first tensor {self.messages[0].chunks[0].tensor!r}")
        return ", ".join(parts)


Link = tuple[int, int]


# Post a channel's batched ops once they reach this many bucket sizes (or ops): fewer,
# larger NCCL groups cost fewer launches; batching never delays a wait (all pending ops
# are posted before any wait).
GROUP_BUCKETS = 4


GROUP_MAX_OPS = 64

# 1: groups grow from a quarter bucket to GROUP_BUCKETS buckets over the first posts and
# shrink toward the end of the schedule (`group_limit`); 0: every group GROUP_BUCKETS buckets
# (the shape before 2026-11-27, for measuring one against the other).
GROUP_TAPER = launch_setting("REFIT_GROUP_TAPER", 1, 0, 1)


def group_limit(
    posted: int, bytes_after: int, bucket_bytes: int, channels: int, taper: int | None = None
) -> int:
    """The bytes a channel's group reaches before every channel's group is posted, after
    `posted` posts, with `bytes_after` bytes of this rank's messages still to come after
    the current step.

    Bytes move only once posted, and a receiver sums a group only once all of it arrived:
    the first group's size is a wait before the first byte moves, the last group's sums are
    a wait after the last one arrived (with 4 channels of 1 GiB groups on Qwen3-8B, ~1 ms at
    each end). So the first group is a quarter bucket and each post doubles it up to
    GROUP_BUCKETS buckets; near the end a group is at most half of what remains per
    channel, so the groups halve down to single messages and the last sums cover one."""
    full = GROUP_BUCKETS * bucket_bytes
    if not (GROUP_TAPER if taper is None else taper):
        return full
    ramp = (bucket_bytes // 4) << min(posted, 8)
    taper_to = bytes_after // (2 * max(1, channels))
    return max(1, min(full, ramp, taper_to))
