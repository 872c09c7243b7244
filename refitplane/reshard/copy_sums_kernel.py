"""The Triton kernel of `copy_sums.py` (imported only where Triton is installed): copies
contiguous byte chunks, one table row each (first program, source, destination, bytes,
output row), and adds each chunk's (S0, S1) as `checksum.py` defines them into its row."""

from __future__ import annotations

import triton
import triton.language as tl

from refitplane.reshard.triton_rows import program_row_of
from refitplane.reshard.triton_sums import add_sums, add_words, tail_word


# Triton reads the signature: no Python annotations inside the kernel.
@triton.jit(do_not_specialize=["tab", "n"])  # type: ignore[untyped-decorator]
def copy_sums(  # type: ignore[no-untyped-def]  # noqa: ANN201
    tab,  # noqa: ANN001
    n,  # noqa: ANN001
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    STEPS: tl.constexpr,
    ROW: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = program_row_of(tab, n, pid, STEPS, ROW)
    src = tl.load(row + 1)
    dst = tl.load(row + 2)
    n_bytes = tl.load(row + 3)
    out = tl.load(row + 4).to(tl.pointer_type(tl.int64))
    n_words = n_bytes // 8
    src_words = src.to(tl.pointer_type(tl.int64))
    dst_words = dst.to(tl.pointer_type(tl.int64))
    if ALIGNED:
        # An address read from the table tells the compiler nothing, and it then moves 8
        # bytes at a time instead of 16: where every chunk of the launch is 16-byte
        # aligned on both ends, say so (as `delta_kernels.py` does).
        src_words = tl.multiple_of(src_words, 16)
        dst_words = tl.multiple_of(dst_words, 16)
    base = (pid - tl.load(row)) * BLOCK * ITERS
    acc0 = tl.zeros([BLOCK], dtype=tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    if ALIGNED and base + BLOCK * ITERS <= n_words:
        # A program wholly inside its chunk (all but a chunk's last) moves its words
        # unmasked: a mask per word would keep Triton from 16-byte accesses too.
        for it in range(ITERS):
            offs = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(src_words + offs)
            tl.store(dst_words + offs, x)
            acc0, acc1 = add_words(acc0, acc1, x, 0, offs)
    else:
        for it in range(ITERS):
            offs = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < n_words
            x = tl.load(src_words + offs, mask=mask, other=0)
            tl.store(dst_words + offs, x, mask=mask)
            acc0, acc1 = add_words(acc0, acc1, x, 0, offs)
    # A last partial word (1-7 bytes): copied bytewise, summed zero-padded, by the
    # program whose range holds it.
    lane = tl.arange(0, 8).to(tl.int64)
    mine = (n_words >= base) & (n_words < base + BLOCK * ITERS)
    tail_mask = lane < tl.where(mine, n_bytes - n_words * 8, 0)
    src_tail = src.to(tl.pointer_type(tl.uint8)) + n_words * 8 + lane
    dst_tail = dst.to(tl.pointer_type(tl.uint8)) + n_words * 8 + lane
    tail_bytes = tl.load(src_tail, mask=tail_mask, other=0)
    tl.store(dst_tail, tail_bytes, mask=tail_mask)
    add_sums(out, acc0, acc1, tail_word(tail_bytes, lane), n_words)
