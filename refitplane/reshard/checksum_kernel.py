"""The Triton kernel of `checksum.py` (imported only where Triton is installed).

One launch sums many buffers: a table row per buffer (8-byte aligned address, byte count,
output address, first program) maps each program to a buffer (binary search on the
first-program column), and the program adds its part's (S0, S1) into that buffer's output
pair (int64 atomics, `triton_sums`): no partial sums to reduce, one launch per group of
messages. A last partial word (1-7 bytes) is read bytewise by the program whose range
holds it, zero-padded like the reference.

Exactly one variant is ever compiled: the search runs a fixed number of steps and Triton
does not specialize the arguments (a new variant means compiling and loading a module,
which must not happen while a transfer is in flight; see `checksum.LaunchTables`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from refitplane.reshard.triton_rows import program_row
from refitplane.reshard.triton_sums import add_sums, add_words, tail_word


# Triton reads the signature: no Python annotations inside the kernel.
@triton.jit(do_not_specialize=["tab", "n"])  # type: ignore[untyped-decorator]
def sums_into(tab, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    pid = tl.program_id(0).to(tl.int64)
    row = program_row(tab, n, pid, STEPS)
    address = tl.load(row)
    x_ptr = address.to(tl.pointer_type(tl.int64))
    n_bytes = tl.load(row + 1)
    n_words = n_bytes // 8  # whole words; a tail of n_bytes % 8 bytes follows
    out_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int64))
    base = (pid - tl.load(row + 3)) * BLOCK * ITERS
    acc0 = tl.zeros([BLOCK], dtype=tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    for it in range(ITERS):
        offs = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n_words
        x = tl.load(x_ptr + offs, mask=mask, other=0)
        acc0, acc1 = add_words(acc0, acc1, x, 0, offs)
    lane = tl.arange(0, 8).to(tl.int64)
    mine = (n_words >= base) & (n_words < base + BLOCK * ITERS)
    tail_mask = lane < tl.where(mine, n_bytes - n_words * 8, 0)
    byte_ptr = address.to(tl.pointer_type(tl.uint8))
    tail_bytes = tl.load(byte_ptr + n_words * 8 + lane, mask=tail_mask, other=0)
    add_sums(out_ptr, acc0, acc1, tail_word(tail_bytes, lane), n_words)
