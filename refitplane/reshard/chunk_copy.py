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

_BLOCK = 1024
_ITERS = 16
_BYTES_PER_PROGRAM = 8 * _BLOCK * _ITERS
_SEARCH_STEPS = 20
# Staging slices start at multiples of this (`staging.py`); Triton specializes a pointer
# argument on 16-byte alignment, so every launch sees the same variant.
_SLICE_ALIGN = 16

# REFIT_COPY_KERNEL=0 packs and unpacks with `_foreach_copy_` (to measure what it saves).
ENABLED = os.environ.get("REFIT_COPY_KERNEL", "1") != "0"

_kernel: Any = None
_program_row: Any = None
_add_words: Any = None
_add_sums: Any = None


def triton_kernel() -> Any:
    """The compiled-on-first-use kernel, or None where Triton cannot run."""
    global _kernel, _program_row, _add_words, _add_sums
    if _kernel is not None:
        return _kernel or None
    try:
        import triton
        import triton.language as tl

        from refitplane.reshard import triton_rows, triton_sums
    except ImportError:
        _kernel = False
        return None

    # The kernel finds its row with the shared search and adds the checksum sums with the
    # shared helpers; Triton resolves them as globals.
    _program_row = triton_rows.program_row
    _add_words, _add_sums = triton_sums.add_words, triton_sums.add_sums

    # Triton reads the signature: no Python annotations inside the kernel.
    @triton.jit(do_not_specialize=["tab", "n", "buf", "out"])  # type: ignore[untyped-decorator]
    def _copy_chunks(  # type: ignore[no-untyped-def]  # noqa: ANN202
        tab,  # noqa: ANN001
        n,  # noqa: ANN001
        buf,  # noqa: ANN001
        out,  # noqa: ANN001
        SCATTER: tl.constexpr,
        SUMS: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row = _program_row(tab, n, pid, STEPS)
        local = tl.load(row)
        n_bytes = tl.load(row + 1)
        offset = tl.load(row + 2)
        n_words = n_bytes // 8
        local_words = local.to(tl.pointer_type(tl.int64))
        message_bytes = buf + offset
        message_words = message_bytes.to(tl.pointer_type(tl.int64))
        base = (pid - tl.load(row + 3)) * BLOCK * ITERS
        first_word = offset // 8  # the chunk's first word in the message (SUMS: exact)
        acc0 = tl.zeros([BLOCK], dtype=tl.int64)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        for it in range(ITERS):
            offs = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < n_words
            if SCATTER:
                tl.store(local_words + offs, tl.load(message_words + offs, mask=mask), mask=mask)
            else:
                x = tl.load(local_words + offs, mask=mask, other=0)
                tl.store(message_words + offs, x, mask=mask)
                if SUMS:
                    acc0, acc1 = _add_words(acc0, acc1, x, first_word, offs)
        if SUMS:
            # The message's (S0, S1) as `checksum.py` defines them: its chunks are whole
            # words, back to back, so these are all of its words (no tail word).
            _add_sums(out, acc0, acc1, 0, 0)
        lane = tl.arange(0, 8).to(tl.int64)
        mine = (n_words >= base) & (n_words < base + BLOCK * ITERS)
        tail_mask = lane < tl.where(mine, n_bytes - n_words * 8, 0)
        local_tail = local.to(tl.pointer_type(tl.uint8)) + n_words * 8 + lane
        message_tail = message_bytes + n_words * 8 + lane
        if SCATTER:
            tl.store(local_tail, tl.load(message_tail, mask=tail_mask), mask=tail_mask)
        else:
            tl.store(message_tail, tl.load(local_tail, mask=tail_mask), mask=tail_mask)

    _kernel = _copy_chunks
    return _kernel


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
