"""From a rank's plan to the exact sequence of messages it exchanges.

Both ends of a link derive the same messages from the same link and config, so byte counts
always match (a mismatch is how NCCL P2P hangs). Cutting rules, per link in piece order:

- a piece larger than `bucket_bytes` is cut into row blocks of at most `bucket_bytes`;
- a chunk of at least half a bucket, or of at least `config.direct_min_bytes`, travels alone, so
  it can go straight from/to parameter memory when that side's view is contiguous (packing
  costs two extra copies of every byte; NCCL runs near its peak from a few tens of MiB);
- smaller chunks are packed together up to `bucket_bytes`.

Message `i` of a link belongs to round `i` and to channel `i % num_channels`. Every rank
processes its messages in the global order (round, src, dst); ops of a round may be grouped,
and waits only ever target a rank's own earlier messages, so the globally smallest
unfinished message always has both ends posted: no deadlock, whatever the plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from refitplane.reshard.boxes import Box, box_numel, split_rows
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import Link, RankPlan

# Chunks start at multiples of this inside a message (checksums read 8-byte words).
ALIGN = 16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class Chunk:
    tensor: str
    box: Box
    nbytes: int
    # Byte offset of this chunk inside its message.
    offset: int
    # Index of this chunk among all chunks of its link.
    index: int


@dataclass(frozen=True, slots=True)
class Message:
    src: int
    dst: int
    round: int
    channel: int
    chunks: tuple[Chunk, ...]
    nbytes: int


def link_chunks(
    link: Link, specs: Mapping[str, TensorSpec], bucket_bytes: int
) -> Iterator[tuple[str, Box, int]]:
    """Every (tensor, box, nbytes) chunk of a link, in order."""
    for piece in link.pieces:
        size = specs[piece.tensor].itemsize
        max_elems = max(1, bucket_bytes // size)
        for box in split_rows(piece.box, max_elems):
            yield piece.tensor, box, box_numel(box) * size


def link_messages(
    link: Link, specs: Mapping[str, TensorSpec], config: TransferConfig
) -> list[Message]:
    bucket = config.bucket_bytes
    messages: list[Message] = []
    current: list[Chunk] = []
    filled = 0

    def flush() -> None:
        nonlocal current, filled
        if current:
            r = len(messages)
            messages.append(
                Message(link.src, link.dst, r, r % config.num_channels, tuple(current), filled)
            )
            current, filled = [], 0

    for index, (tensor, box, nbytes) in enumerate(link_chunks(link, specs, bucket)):
        if 2 * nbytes >= bucket or nbytes >= config.direct_min_bytes:
            flush()
            current, filled = [Chunk(tensor, box, nbytes, 0, index)], nbytes
            flush()
            continue
        if _align(filled) + nbytes > bucket:
            flush()
        offset = _align(filled)
        current.append(Chunk(tensor, box, nbytes, offset, index))
        filled = offset + nbytes
    flush()
    return messages


@dataclass(frozen=True)
class RankSchedule:
    """A rank's messages grouped by round, each round in (src, dst) order."""

    rounds: tuple[tuple[Message, ...], ...]
    # Messages per link, keyed by (src, dst): the length of its checksum vector.
    messages_per_link: Mapping[tuple[int, int], int]

    @property
    def messages(self) -> Iterator[Message]:
        for r in self.rounds:
            yield from r


def rank_schedule(plan: RankPlan, config: TransferConfig) -> RankSchedule:
    by_round: dict[int, list[Message]] = {}
    counts: dict[tuple[int, int], int] = {}
    for link in (*plan.sends, *plan.recvs):
        msgs = link_messages(link, plan.specs, config)
        counts[(link.src, link.dst)] = len(msgs)
        for m in msgs:
            by_round.setdefault(m.round, []).append(m)
    rounds = tuple(
        tuple(sorted(by_round[r], key=lambda m: (m.src, m.dst))) for r in sorted(by_round)
    )
    return RankSchedule(rounds, counts)
