"""Triton kernels for delta encoding on CUDA: what `delta.py` does with torch ops, in
fewer passes over memory.

torch needs a boolean mask (written, then read again), `count_nonzero`, `nonzero` and a
gather; at HBM speed each is a pass. Here `count` reads both images once per block of words
and writes one count per block (`delta.changed_words`).

The sender's path (`scan` then `gather`) reads both images exactly once: `scan`
writes per block the count and the bitmap and, where asked, the changed words into the
base (the snapshot becomes the current version in the same pass); `gather` then reads only
the bitmap and the changed words (masked loads: the sectors that hold one) and writes the
payload at each block's exclusive prefix sum, in ascending index order: byte-identical to
the torch path. The receiver's `scatter_index` / `scatter_bitmap` write the values into its image
the same way, without torch's int64 index or boolean mask.

Compiled on first use; `available()` is False where Triton or CUDA is missing, and
`delta.py` then keeps to torch.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_BLOCK = 4096  # words per program (a multiple of 8: bitmap bytes never straddle programs)
_kernels: Any = None


def _compile() -> Any:
    global _kernels
    if _kernels is not None:
        return _kernels or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _kernels = False
        return None

    # Triton reads the signature: no Python annotations inside the kernels.
    @triton.jit  # type: ignore[untyped-decorator]
    def block(cur, base, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        """This program's block: word offsets, current words, and which changed."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        a = tl.load(cur + offs, mask=inside, other=0)
        b = tl.load(base + offs, mask=inside, other=0)
        return offs, a, (a != b) & inside

    @triton.jit  # type: ignore[untyped-decorator]
    def count(cur, base, counts, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        _, _, changed = block(cur, base, n, BLOCK)
        tl.store(counts + tl.program_id(0), tl.sum(changed.to(tl.int32), axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def scan(cur, base, counts, bits, n, nbytes, BLOCK: tl.constexpr, UPDATE: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        offs, a, changed = block(cur, base, n, BLOCK)
        tl.store(counts + tl.program_id(0), tl.sum(changed.to(tl.int32), axis=0))
        weights = 1 << tl.arange(0, 8)
        packed = tl.sum(
            tl.reshape(changed.to(tl.int32), (BLOCK // 8, 8)) * weights[None, :], axis=1
        )
        at = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits + at, packed.to(tl.uint8), mask=at < nbytes)
        if UPDATE:
            tl.store(base + offs, a, mask=changed)

    @triton.jit  # type: ignore[untyped-decorator]
    def flags_of(bits, n, nbytes, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        """This program's block: word offsets and which changed, read from the bitmap."""
        at = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        packed = tl.load(bits + at, mask=at < nbytes, other=0).to(tl.int32)
        flags = tl.reshape((packed[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,))
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        return offs, flags * (offs < n).to(tl.int32)

    @triton.jit  # type: ignore[untyped-decorator]
    def gather(cur, bits, starts, index, values, n, nb, BLOCK: tl.constexpr, INDEXED: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        offs, flags = flags_of(bits, n, nb, BLOCK)
        changed = flags != 0
        at = tl.load(starts + tl.program_id(0)) + tl.cumsum(flags, axis=0) - flags
        a = tl.load(cur + offs, mask=changed, other=0)
        if INDEXED:
            tl.store(index + at, offs.to(tl.int32), mask=changed)
        tl.store(values + at, a, mask=changed)

    @triton.jit  # type: ignore[untyped-decorator]
    def bit_counts(bits, counts, n, nbytes, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        _, flags = flags_of(bits, n, nbytes, BLOCK)
        tl.store(counts + tl.program_id(0), tl.sum(flags, axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def scatter_bits(dst, bits, starts, values, nvalues, n, nbytes, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        offs, flags = flags_of(bits, n, nbytes, BLOCK)
        at = tl.load(starts + tl.program_id(0)) + tl.cumsum(flags, axis=0) - flags
        # More flags than values (a bad payload): the surplus is left alone, and the
        # per-message checksums report the bytes wrong.
        changed = (flags != 0) & (at < nvalues)
        v = tl.load(values + at, mask=changed, other=0)
        tl.store(dst + offs, v, mask=changed)

    @triton.jit  # type: ignore[untyped-decorator]
    def scatter_index(dst, index, values, changed, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < changed
        where = tl.load(index + at, mask=inside, other=0).to(tl.int64)
        # An index outside the message (a bad payload) writes nothing; the checksums of
        # the end state then fail the message, naming its tensors.
        inside = inside & (where >= 0) & (where < n)
        tl.store(dst + where, tl.load(values + at, mask=inside, other=0), mask=inside)

    # The kernels call the helpers by name: Triton's interpreter (TRITON_INTERPRET=1) looks
    # names up in the module's globals.
    globals().update(block=block, flags_of=flags_of)
    _kernels = (count, scan, gather, bit_counts, scatter_bits, scatter_index)
    return _kernels


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels serve `tensor` (CUDA, Triton present, and not turned off with
    REFIT_DELTA_KERNELS=torch, the escape hatch and the benchmark's baseline)."""
    if tensor.device.type != "cuda" or os.environ.get("REFIT_DELTA_KERNELS") == "torch":
        return False
    return _compile() is not None


def _grid(words: int) -> tuple[int]:
    return (max(1, (words + _BLOCK - 1) // _BLOCK),)


def block_counts(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Changed words per block of `_BLOCK` (int32), for words `cur` vs `base`."""
    count = _compile()[0]
    (programs,) = _grid(cur.numel())
    counts = torch.empty(programs, dtype=torch.int32, device=cur.device)
    count[(programs,)](cur, base, counts, cur.numel(), BLOCK=_BLOCK)
    return counts


def _starts(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0, dtype=torch.int64) - counts


def scan(
    cur: torch.Tensor, base: torch.Tensor, bits: torch.Tensor, *, update: bool
) -> torch.Tensor:
    """One pass over `cur` and `base`: which words changed into `bits` (one bit per word,
    bit i % 8 of byte i // 8), and, with `update`, the changed words written into `base`. Returns
    the changed words per block (int32)."""
    kernel = _compile()[1]
    (programs,) = _grid(cur.numel())
    counts = torch.empty(programs, dtype=torch.int32, device=cur.device)
    kernel[(programs,)](
        cur, base, counts, bits, cur.numel(), bits.numel(), BLOCK=_BLOCK, UPDATE=update
    )
    return counts


def gather(
    cur: torch.Tensor,
    bits: torch.Tensor,
    counts: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor | None,
) -> None:
    """The words of `cur` flagged in `bits` into `values` (and their int32 indices into
    `index`), in ascending index order; `counts` as `scan` returned them."""
    kernel = _compile()[2]
    target = index if index is not None else values  # unused when INDEXED is off
    kernel[_grid(cur.numel())](
        cur,
        bits,
        _starts(counts),
        target,
        values,
        cur.numel(),
        bits.numel(),
        BLOCK=_BLOCK,
        INDEXED=index is not None,
    )


def scatter_bitmap(dst: torch.Tensor, bits: torch.Tensor, values: torch.Tensor) -> None:
    """Apply a bitmap payload: the i-th flagged word of `dst` becomes `values[i]`."""
    _, _, _, bit_counts, kernel, _ = _compile()
    (programs,) = _grid(dst.numel())
    counts = torch.empty(programs, dtype=torch.int32, device=dst.device)
    bit_counts[(programs,)](bits, counts, dst.numel(), bits.numel(), BLOCK=_BLOCK)
    kernel[(programs,)](
        dst, bits, _starts(counts), values, values.numel(), dst.numel(), bits.numel(), BLOCK=_BLOCK
    )


def scatter_index(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Apply an index payload: `dst[index[i]] = values[i]` (int32 indices)."""
    if index.numel() == 0:
        return
    kernel = _compile()[5]
    kernel[_grid(index.numel())](dst, index, values, index.numel(), dst.numel(), BLOCK=_BLOCK)
