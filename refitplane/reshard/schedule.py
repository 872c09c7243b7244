"""From a rank's plan to the exact sequence of messages it exchanges.

Both ends of a link derive the same messages from the same link and config, so byte counts
always match (a mismatch is how NCCL P2P hangs). Cutting rules, per link:

- pieces go in stage order (`stages.py`: the decoder layer of the tensor, from its canonical
  name), the planner's order within a stage, and no message holds chunks of two stages, so
  a receiver that stages checkpoint tensors can apply a layer once its messages are in;
- a piece larger than `bucket_bytes` is cut into row blocks of at most `bucket_bytes`;
- a chunk of at least half a bucket, or of at least `config.direct_min_bytes`, travels alone, so
  it can go straight from/to parameter memory when that side's view is contiguous (packing
  costs two extra copies of every byte; NCCL runs near its peak from a few tens of MiB);
- smaller chunks of one stage are packed together up to `bucket_bytes`.

Message `i` of a link has `round` `i` (its row in the link's checksum vector) and channel
`i % num_channels`; its `step` is its index among the link's messages of its stage. Every
rank processes its messages in the global order (stage, step, src, dst) — a total order
both ends of every message compute alike; ops of one (stage, step) may be grouped, and waits
only ever target a rank's own earlier messages, so the globally smallest unfinished message
always has both ends posted: no deadlock, whatever the plan. (A receiver that stops between
stages to apply what it staged only delays its peers: it waits on nothing of theirs.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from refitplane.reshard.boxes import Box, box_numel, split_rows
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan
from refitplane.reshard.stages import StageKey, stage_of

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
    # Index among the link's messages: its row in the link's checksum vector.
    round: int
    channel: int
    chunks: tuple[Chunk, ...]
    nbytes: int
    # The stage of every chunk, and the message's index among the link's messages of it.
    stage: StageKey = ("", -1)
    step: int = 0


def staged_pieces(link: Link) -> list[Piece]:
    """The link's pieces in stage order (the planner's order within a stage)."""
    return sorted(link.pieces, key=lambda piece: stage_of(piece.tensor))


def link_chunks(
    link: Link, specs: Mapping[str, TensorSpec], bucket_bytes: int
) -> Iterator[tuple[str, Box, int]]:
    """Every (tensor, box, nbytes) chunk of a link, in order."""
    for piece in staged_pieces(link):
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
    stage: StageKey | None = None
    stage_start = 0  # index of the stage's first message

    def flush() -> None:
        nonlocal current, filled
        if current:
            r = len(messages)
            messages.append(
                Message(
                    link.src,
                    link.dst,
                    r,
                    r % config.num_channels,
                    tuple(current),
                    filled,
                    stage_of(current[0].tensor),
                    r - stage_start,
                )
            )
            current, filled = [], 0

    for index, (tensor, box, nbytes) in enumerate(link_chunks(link, specs, bucket)):
        tensor_stage = stage_of(tensor)
        if tensor_stage != stage:
            flush()  # a message never spans two stages
            stage, stage_start = tensor_stage, len(messages)
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
    """A rank's messages grouped by (stage, step) in that order, each group in (src, dst)
    order: the order the rank processes them in."""

    steps: tuple[tuple[Message, ...], ...]
    # Messages per link, keyed by (src, dst): the length of its checksum vector.
    messages_per_link: Mapping[tuple[int, int], int]

    @property
    def messages(self) -> Iterator[Message]:
        for step in self.steps:
            yield from step

    def receive_stages(self, rank: int) -> list[tuple[StageKey, list[str]]]:
        """The stages `rank` receives in, in order, each with the tensors it receives in
        that stage (sorted)."""
        out: dict[StageKey, set[str]] = {}
        for m in self.messages:
            if m.dst == rank:
                out.setdefault(m.stage, set()).update(c.tensor for c in m.chunks)
        return [(stage, sorted(names)) for stage, names in out.items()]


def rank_schedule(plan: RankPlan, config: TransferConfig) -> RankSchedule:
    by_step: dict[tuple[StageKey, int], list[Message]] = {}
    counts: dict[tuple[int, int], int] = {}
    for link in (*plan.sends, *plan.recvs):
        msgs = link_messages(link, plan.specs, config)
        counts[(link.src, link.dst)] = len(msgs)
        for m in msgs:
            by_step.setdefault((m.stage, m.step), []).append(m)
    steps = tuple(
        tuple(sorted(by_step[key], key=lambda m: (m.src, m.dst))) for key in sorted(by_step)
    )
    return RankSchedule(steps, counts)
