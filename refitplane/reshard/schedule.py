"""From a rank's plan to the exact sequence of messages it exchanges.

Both ends of a link derive the same messages from the same link and config, so byte counts
always match (a mismatch is how NCCL P2P hangs). Cutting rules, per link:

- pieces go in stage order (`stages.py`: the decoder layer of the tensor, from its canonical
  name), and no message holds chunks of two stages, so a receiver that stages checkpoint
  tensors can apply a layer once its messages are in;
- within a stage, the pieces of a *fused run* (`runs.py`: tensors that inference engines
  keep side by side in one parameter, e.g. every expert's gate and up projection in a MoE
  layer's `w13` [E, 2I, H]) go in that memory order, after the stage's other pieces (which
  keep the planner's order); a packed message never mixes two runs (or a run and other
  tensors), so on a receiver that holds the run contiguously it is one span of memory that
  NCCL writes straight into (`message_io.py`), with no staging and no unpacking;
- a piece larger than `bucket_bytes` is cut into row blocks of at most `bucket_bytes`;
- a chunk of at least half a bucket, or of at least `config.direct_min_bytes`, travels alone, so
  it can go straight from/to parameter memory when that side's view is contiguous (packing
  costs two extra copies of every byte; NCCL runs near its peak from a few tens of MiB); the
  packed message being filled meanwhile stays open;
- smaller chunks of one stage are packed together up to `bucket_bytes`; a fused run's chunks
  into messages of even size (as few as fit in buckets).

Message `i` of a link has `round` `i` (its row in the link's checksum vector) and channel
`i % num_channels`; its `step` is its index among the link's messages of its stage. Every
rank processes its messages in the global order (stage, step, src, dst) — a total order
both ends of every message compute alike; ops of one (stage, step) may be grouped, and waits
only ever target a rank's own earlier messages, so the globally smallest unfinished message
always has both ends posted: no deadlock, whatever the plan. (A receiver that stops between
stages to apply what it staged only delays its peers: it waits on nothing of theirs.)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from refitplane.reshard.boxes import Box, box_numel, split_rows
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan
from refitplane.reshard.runs import RunKey, run_key, run_of
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


def _piece_order(piece: Piece) -> tuple[StageKey, RunKey, tuple[int, int]]:
    run = run_of(piece.tensor)
    if run is None:
        return stage_of(piece.tensor), (), (0, 0)
    return stage_of(piece.tensor), run[0], run[1]


def staged_pieces(link: Link) -> list[Piece]:
    """The link's pieces in stage order; within a stage, pieces of no fused run first in the
    planner's order, then each run's pieces in its memory order (a sort is stable: a
    tensor's boxes keep their order)."""
    return sorted(link.pieces, key=_piece_order)


def link_chunks(
    link: Link, specs: Mapping[str, TensorSpec], bucket_bytes: int
) -> Iterator[tuple[str, Box, int]]:
    """Every (tensor, box, nbytes) chunk of a link, in order."""
    for piece in staged_pieces(link):
        size = specs[piece.tensor].itemsize
        max_elems = max(1, bucket_bytes // size)
        for box in split_rows(piece.box, max_elems):
            yield piece.tensor, box, box_numel(box) * size


def _travels_alone(nbytes: int, config: TransferConfig) -> bool:
    return 2 * nbytes >= config.bucket_bytes or nbytes >= config.direct_min_bytes


def _run_targets(chunks: list[tuple[str, Box, int]], config: TransferConfig) -> dict[int, int]:
    """For the first chunk of each fused run (index into `chunks`), the size its packed
    messages are filled to: the run's packed bytes spread evenly over as few messages as
    fit (a 768 MiB run of 3 MiB experts in 256 MiB buckets: 4 x 192 MiB, not 3 x 255 + 3)."""
    targets: dict[int, int] = {}
    i = 0
    while i < len(chunks):
        key, stage = run_key(chunks[i][0]), stage_of(chunks[i][0])
        j, total, largest = i, 0, 0
        while j < len(chunks) and run_key(chunks[j][0]) == key and stage_of(chunks[j][0]) == stage:
            nbytes = chunks[j][2]
            if key and not _travels_alone(nbytes, config):
                total += _align(nbytes)
                largest = max(largest, nbytes)
            j += 1
        if total:
            count = -(-total // max(1, config.bucket_bytes - largest))
            targets[i] = -(-total // count)
        i = j
    return targets


def link_messages(
    link: Link, specs: Mapping[str, TensorSpec], config: TransferConfig
) -> list[Message]:
    bucket = config.bucket_bytes
    chunks = list(link_chunks(link, specs, bucket))
    targets = _run_targets(chunks, config)
    messages: list[Message] = []
    current: list[Chunk] = []
    filled = 0
    target = bucket
    stage: StageKey | None = None
    stage_start = 0  # index of the stage's first message
    run: RunKey = ()  # the fused run of the chunks packed so far (() for none)

    def emit(members: list[Chunk], nbytes: int) -> None:
        r = len(messages)
        messages.append(
            Message(
                link.src,
                link.dst,
                r,
                r % config.num_channels,
                tuple(members),
                nbytes,
                stage_of(members[0].tensor),
                r - stage_start,
            )
        )

    def flush() -> None:
        nonlocal current, filled
        if current:
            emit(current, filled)
            current, filled = [], 0

    for index, (tensor, box, nbytes) in enumerate(chunks):
        tensor_stage = stage_of(tensor)
        if tensor_stage != stage:
            flush()  # a message never spans two stages
            stage, stage_start = tensor_stage, len(messages)
        tensor_run = run_key(tensor)
        if tensor_run != run:
            flush()  # nor two fused runs, nor a run and other tensors
            run = tensor_run
            target = targets.get(index, bucket)
        if _travels_alone(nbytes, config):
            # Alone, and the packed message being filled goes on filling.
            emit([Chunk(tensor, box, nbytes, 0, index)], nbytes)
            continue
        if current and (_align(filled) + nbytes > bucket or filled >= target):
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

    @functools.cached_property
    def bytes_after(self) -> tuple[int, ...]:
        """For each step, the bytes of the messages in the steps after it: what is still to
        come there (`op_group.group_limit` shrinks the last groups by it)."""
        after, out = 0, []
        for step in reversed(self.steps):
            out.append(after)
            after += sum(m.nbytes for m in step)
        return tuple(reversed(out))

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
