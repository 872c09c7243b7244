"""Packing and unpacking a staged message in one kernel launch, whatever its chunk count.

A packed message of a MoE layer holds 64 experts' projections (3 MiB each): copying them
into the staging buffer one tensor at a time costs host work per tensor (views of the
buffer, `_foreach_copy_` argument lists), which on 18,867 tensors is most of a refit. Here
each message's chunks are described once, when the plan is prepared, by a table on the
device (one row per chunk: local address, bytes, offset in the message, first program), and
a pack or unpack is one Triton launch over that table and the staging slice: no per-tensor
work on the host at all.

Like the checksum kernel (`checksum.py`), it maps each program to its chunk by a binary
search of fixed depth and specializes on nothing that varies (no argument is specialized),
so exactly three variants exist (pack, unpack, and pack adding the message's checksum sums
as it copies), compiled and loaded before the first byte moves (loading a module while a
peer's NCCL kernel waits for this rank can deadlock). Chunks are copied as 8-byte words, a
last partial word bytewise; local addresses must be 8-byte aligned (the executor falls back
to `_foreach_copy_` for messages with any chunk that is not). A sender whose message is
whole words back to back (every MoE run message) gets its checksum from the pack itself:
one read of the bytes instead of two, and no checksum launch after the transfer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.reshard.triton_load import load_kernel

_BLOCK = 1024
_ITERS = 16
_BYTES_PER_PROGRAM = 8 * _BLOCK * _ITERS
_SEARCH_STEPS = 20
# Staging slices start at multiples of this (`staging.py`); Triton specializes a pointer
# argument on 16-byte alignment, so every launch sees the same variant.
_SLICE_ALIGN = 16

# REFIT_COPY_KERNEL=0 packs and unpacks with `_foreach_copy_` (to measure what it saves).
ENABLED = os.environ.get("REFIT_COPY_KERNEL", "1") != "0"


def triton_kernel() -> Any:
    """The kernel (`chunk_copy_kernel.py`, compiled on first launch), or None where Triton
    cannot run."""
    return load_kernel("refitplane.reshard.chunk_copy_kernel", "copy_chunks")


@dataclass(frozen=True, slots=True)
class ChunkTable:
    """One message's chunk rows on the device, and the programs a launch over them needs."""

    rows: torch.Tensor
    count: int
    programs: int
    # The chunks are whole 8-byte words lying back to back from the message's start: the
    # pack launch can add the message's checksum sums as it copies (one read of the bytes).
    whole_words: bool = False


def eligible(views: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous 1-D byte `views` can be copied by the kernel (8-byte aligned,
    on a CUDA device, where Triton runs)."""
    return (
        ENABLED
        and bool(views)
        and all(v.is_cuda and not v.data_ptr() % 8 for v in views)
        and triton_kernel() is not None
    )


def build_tables(
    messages: Sequence[tuple[Sequence[torch.Tensor], Sequence[int]]], device: torch.device
) -> list[ChunkTable]:
    """For each message, given as (its chunks' 1-D byte views, their offsets in it), its
    table: all of them in one device allocation (made now, before any transfer), and the
    kernel compiled and loaded in both directions."""
    rows: list[int] = []
    spans: list[tuple[int, int, int, bool]] = []
    for views, offsets in messages:
        start, programs, end, whole = len(rows) // 4, 0, 0, True
        for view, offset in zip(views, offsets, strict=True):
            n = view.numel()
            whole = whole and offset == end and not n % 8
            end = offset + n
            if n:
                rows += [view.data_ptr(), n, offset, programs]
                programs += -(-n // _BYTES_PER_PROGRAM)
        count = len(rows) // 4 - start
        if count >= 1 << _SEARCH_STEPS:
            raise ValueError(f"one copy launch takes under {1 << _SEARCH_STEPS} chunks")
        spans.append((start, count, programs, whole))
    table = torch.tensor(rows or [0, 0, 0, 0], dtype=torch.int64).to(device)
    _load(device)
    return [ChunkTable(table[4 * s : 4 * (s + c)], c, p, w) for s, c, p, w in spans]


# (SCATTER, SUMS): pack, pack adding the checksum sums, unpack.
_VARIANTS = ((False, False), (False, True), (True, False))


def _load(device: torch.device) -> None:
    """Compile and load every variant now (a zero-byte launch each), outside any transfer."""
    kernel = triton_kernel()
    probe = torch.zeros(4 + _SLICE_ALIGN, dtype=torch.int64, device=device)
    buf = probe[4:].view(torch.uint8)
    for scatter, sums in _VARIANTS:
        kernel[(1,)](
            probe,
            1,
            buf,
            probe[4:6],
            SCATTER=scatter,
            SUMS=sums,
            BLOCK=_BLOCK,
            ITERS=_ITERS,
            STEPS=_SEARCH_STEPS,
        )
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def launch(
    table: ChunkTable, buf: torch.Tensor, *, scatter: bool, sums: torch.Tensor | None = None
) -> None:
    """Copy the message's chunks from local memory into `buf` (pack), or from `buf` back
    (`scatter`: unpack), on the current stream, asynchronously. `sums` (pack only, a table
    whose chunks are `whole_words`): two int64 the message's (S0, S1) are added into."""
    if not table.programs:
        return
    if buf.data_ptr() % _SLICE_ALIGN:
        raise ValueError("a staging slice must start 16-byte aligned")
    if sums is not None and (scatter or not table.whole_words):
        raise ValueError("only a pack of whole words adds checksum sums")
    triton_kernel()[(table.programs,)](
        table.rows,
        table.count,
        buf,
        table.rows if sums is None else sums,
        SCATTER=scatter,
        SUMS=sums is not None,
        BLOCK=_BLOCK,
        ITERS=_ITERS,
        STEPS=_SEARCH_STEPS,
    )
