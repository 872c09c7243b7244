"""The Triton kernel of `chunk_copy.py` (imported only where Triton is installed): packs a
message's chunks into its staging slice or unpacks them back, one table row per chunk
(local address, bytes, offset in the message, first program), and in the summing pack adds
the message's (S0, S1) as `checksum.py` defines them (`triton_sums`)."""

from __future__ import annotations

import triton
import triton.language as tl

from refitplane.reshard.triton_rows import program_row
from refitplane.reshard.triton_sums import add_sums, add_words


# Triton reads the signature: no Python annotations inside the kernel.
@triton.jit(do_not_specialize=["tab", "n", "buf", "out"])  # type: ignore[untyped-decorator]
def copy_chunks(  # type: ignore[no-untyped-def]  # noqa: ANN201
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
    row = program_row(tab, n, pid, STEPS)
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
                acc0, acc1 = add_words(acc0, acc1, x, first_word, offs)
    if SUMS:
        # The message's (S0, S1) as `checksum.py` defines them: its chunks are whole
        # words, back to back, so these are all of its words (no tail word).
        add_sums(out, acc0, acc1, 0, 0)
    lane = tl.arange(0, 8).to(tl.int64)
    mine = (n_words >= base) & (n_words < base + BLOCK * ITERS)
    tail_mask = lane < tl.where(mine, n_bytes - n_words * 8, 0)
    local_tail = local.to(tl.pointer_type(tl.uint8)) + n_words * 8 + lane
    message_tail = message_bytes + n_words * 8 + lane
    if SCATTER:
        tl.store(local_tail, tl.load(message_tail, mask=tail_mask), mask=tail_mask)
    else:
        tl.store(message_tail, tl.load(local_tail, mask=tail_mask), mask=tail_mask)
