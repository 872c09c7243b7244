"""Triton kernels for delta encoding on CUDA: what `delta.py` does with torch ops, in
fewer passes over memory.

torch needs a boolean mask (written, then read again), `count_nonzero`, `nonzero` and a
gather; at HBM speed each is a pass. Here a pass reads both images once per block of words:
`count` writes one count per block; `compact` reads the blocks again and writes the changed
words' indices (optional) and values at their block's exclusive prefix sum, so the output
is in ascending index order, byte-identical to the torch path; `bitmap` writes one bit per
word. Compiled on first use; `available()` is False where Triton or CUDA is missing, and
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
    def compact(cur, base, starts, index, values, n, BLOCK: tl.constexpr, WITH_INDEX: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        offs, a, changed = block(cur, base, n, BLOCK)
        flags = changed.to(tl.int32)
        at = tl.load(starts + tl.program_id(0)) + tl.cumsum(flags, axis=0) - flags
        if WITH_INDEX:
            tl.store(index + at, offs.to(tl.int32), mask=changed)
        tl.store(values + at, a, mask=changed)

    @triton.jit  # type: ignore[untyped-decorator]
    def bitmap(cur, base, out, n, nbytes, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        _, _, changed = block(cur, base, n, BLOCK)
        weights = 1 << tl.arange(0, 8)
        packed = tl.sum(
            tl.reshape(changed.to(tl.int32), (BLOCK // 8, 8)) * weights[None, :], axis=1
        )
        at = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(out + at, packed.to(tl.uint8), mask=at < nbytes)

    _kernels = (count, compact, bitmap)
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
    count, _, _ = _compile()
    (programs,) = _grid(cur.numel())
    counts = torch.empty(programs, dtype=torch.int32, device=cur.device)
    count[(programs,)](cur, base, counts, cur.numel(), BLOCK=_BLOCK)
    return counts


def compact(
    cur: torch.Tensor, base: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None
) -> None:
    """The changed words of `cur` into `values` (and their int32 indices into `index`),
    in ascending index order."""
    _, kernel, _ = _compile()
    counts = block_counts(cur, base)
    starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    target = index if index is not None else values  # unused when WITH_INDEX is off
    kernel[_grid(cur.numel())](
        cur, base, starts, target, values, cur.numel(), BLOCK=_BLOCK, WITH_INDEX=index is not None
    )


def pack_bitmap(cur: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> None:
    """Bit i % 8 of byte i // 8 of `out`: whether word i changed."""
    _, _, kernel = _compile()
    kernel[_grid(cur.numel())](cur, base, out, cur.numel(), out.numel(), BLOCK=_BLOCK)
