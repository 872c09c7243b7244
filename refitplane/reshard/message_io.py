"""Each message's local memory, resolved once and kept while plan and shards stay the same.

A message either goes straight from/to local memory (`MessageIO.direct`, its bytes: one
chunk whose view is contiguous, or chunks whose views lie back to back in one allocation
exactly as they lie in the message, e.g. a fused run of experts in vLLM's `w13`, see
`runs.py`) or through a staging buffer. For a staged message the
chunks' slices of that buffer come from one `split` (chunk, alignment gap, chunk, ...), and
each chunk is copied to/from local memory either in bulk — contiguous local memory, as
1-D bytes, gathered with every other such chunk of the group into one `torch._foreach_copy_`
(a few kernel launches for hundreds of small tensors instead of one launch each) — or
alone, through a typed strided view (resharded boxes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, replace

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import box_shape
from refitplane.reshard.chunk_copy import ChunkTable, build_tables, eligible
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.schedule import Message, RankSchedule
from refitplane.reshard.shards import LocalShards, torch_dtype

# REFIT_DIRECT_SPANS=0 stages multi-chunk messages even where local memory is one span (to
# measure what the spans save; both ends decide this alone, so it needs no agreement).
DIRECT_SPANS = os.environ.get("REFIT_DIRECT_SPANS", "1") != "0"


@dataclass(frozen=True, slots=True)
class StridedChunk:
    """A staged chunk whose local view is not contiguous: copied alone, typed."""

    index: int  # among the message's chunks
    view: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]

    def typed(self, part: torch.Tensor) -> torch.Tensor:
        """The chunk's bytes in a staging buffer, as the local view's dtype and shape."""
        return part.view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class MessageIO:
    # Direct messages: the local memory's bytes (1-D uint8); None for staged ones.
    direct: torch.Tensor | None
    # Tensor bytes the message carries (its size less alignment gaps).
    payload: int
    # Staged messages: sizes that split a staging buffer into chunk, gap, chunk, ... .
    split: tuple[int, ...] = ()
    # Chunks with contiguous local memory: their indices and 1-D uint8 views.
    flat: tuple[int, ...] = ()
    flat_views: tuple[torch.Tensor, ...] = ()
    strided: tuple[StridedChunk, ...] = ()
    # Staged messages on CUDA whose chunks are all flat and 8-byte aligned: their chunk
    # table, packed/unpacked by one kernel launch (`chunk_copy.py`); set when the plan is
    # prepared.
    copy: ChunkTable | None = None

    def parts(self, buf: torch.Tensor) -> Sequence[torch.Tensor]:
        """Every chunk's slice of the staging buffer `buf`, in chunk order."""
        pieces: tuple[torch.Tensor, ...] = torch.split_with_sizes(buf, self.split)
        return pieces[::2]


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    """A contiguous view's memory as 1-D bytes. (Not `reshape(-1)`: a contiguous view may
    keep any stride on a dimension of size 1, e.g. a single element of a transposed
    matrix, and `view(torch.uint8)` needs a unit stride.)"""
    return view.as_strided((view.numel(),), (1,)).view(torch.uint8)


def _span(m: Message, views: list[torch.Tensor]) -> torch.Tensor | None:
    """The message's local memory as one byte span, if its chunks' views are contiguous and
    lie back to back in one allocation at the message's own offsets (no gaps: a gap would be
    someone else's bytes); else None."""
    first = views[0]
    storage = first.untyped_storage()
    start = first.data_ptr()
    end = 0
    for chunk, view in zip(m.chunks, views, strict=True):
        if (
            chunk.offset != end
            or not view.is_contiguous()
            or view.data_ptr() != start + chunk.offset
            or view.untyped_storage().data_ptr() != storage.data_ptr()
        ):
            return None
        end = chunk.offset + chunk.nbytes
    offset = start - storage.data_ptr()
    if end != m.nbytes or offset + end > storage.nbytes():
        return None
    span = torch.empty(0, dtype=torch.uint8, device=first.device)
    return span.set_(storage, offset, (end,), (1,))


def message_io(m: Message, views: list[torch.Tensor], specs: Mapping[str, TensorSpec]) -> MessageIO:
    payload = sum(c.nbytes for c in m.chunks)
    if len(views) == 1 and views[0].is_contiguous():
        return MessageIO(_as_bytes(views[0]), payload)
    span = _span(m, views) if DIRECT_SPANS else None
    if span is not None:
        return MessageIO(span, payload)
    split: list[int] = []
    end = 0
    for chunk in m.chunks:
        if split:
            split.append(chunk.offset - end)  # the alignment gap before this chunk
        split.append(chunk.nbytes)
        end = chunk.offset + chunk.nbytes
    flat, flat_views, strided = [], [], []
    for i, (chunk, view) in enumerate(zip(m.chunks, views, strict=True)):
        if view.is_contiguous():
            flat.append(i)
            flat_views.append(_as_bytes(view))
        else:
            dtype = torch_dtype(specs[chunk.tensor].dtype)
            strided.append(StridedChunk(i, view, dtype, box_shape(chunk.box)))
    return MessageIO(None, payload, tuple(split), tuple(flat), tuple(flat_views), tuple(strided))


def resolve_messages(
    plan: RankPlan,
    schedule: RankSchedule,
    shards: LocalShards,
    deferred: Set[str] = frozenset(),
) -> tuple[tuple[tuple[Message, MessageIO | None], ...], ...]:
    """The schedule's steps with every message's local memory, each view checked against
    the plan before any byte moves. A message with a chunk of a `deferred` tensor (staged:
    its memory exists only while its bucket is open) gets None, resolved later by
    `resolve_message`."""
    for name, spec in plan.specs.items():
        try:
            local = shards.spec(name)
        except KeyError:
            raise LayoutError(
                f"the plan moves this tensor but rank {plan.rank} registered no storage for it",
                tensor=name,
                rank=plan.rank,
            ) from None
        if local != spec:
            raise LayoutError(
                f"plan expects {list(spec.shape)} {spec.dtype}, rank {plan.rank} holds "
                f"{list(local.shape)} {local.dtype}",
                tensor=name,
                rank=plan.rank,
            )
    return tuple(
        tuple(
            (
                m,
                None
                if deferred and any(c.tensor in deferred for c in m.chunks)
                else resolve_message(m, shards, plan.specs),
            )
            for m in step
        )
        for step in schedule.steps
    )


def resolve_message(m: Message, shards: LocalShards, specs: Mapping[str, TensorSpec]) -> MessageIO:
    """One message's local memory, from the views `shards` gives for its chunks now."""
    return message_io(m, [shards.view(c.tensor, c.box) for c in m.chunks], specs)


def with_copy_tables(
    steps: tuple[tuple[tuple[Message, MessageIO | None], ...], ...], device: torch.device
) -> tuple[tuple[tuple[Message, MessageIO | None], ...], ...]:
    """`steps` with a chunk table for every staged message the copy kernel can pack and
    unpack (all chunks flat and aligned, on CUDA); the others unchanged."""
    if device.type != "cuda":
        return steps
    chosen = [
        (m, io)
        for step in steps
        for m, io in step
        if io is not None and io.direct is None and not io.strided and eligible(io.flat_views)
    ]
    if not chosen:
        return steps
    tables = build_tables(
        [(io.flat_views, [m.chunks[i].offset for i in io.flat]) for m, io in chosen], device
    )
    table_of = {id(io): table for (_, io), table in zip(chosen, tables, strict=True)}
    return tuple(
        tuple(
            (m, io if io is None or id(io) not in table_of else replace(io, copy=table_of[id(io)]))
            for m, io in step
        )
        for step in steps
    )
