"""The checksum sums of `checksum.py` as Triton helpers, shared by every kernel that adds
them: the checksum kernel (`checksum.py`), the copy that checksums (`copy_sums_kernel.py`)
and the pack that checksums (`chunk_copy.py`).

Each program keeps per-lane partial sums of its words `x_i` (`add_words`: S0 += x_i,
S1 += i * x_i, i the word's index in the whole buffer), reads a last partial word of 1-7
bytes zero-padded (`tail_word`), and adds its part into the buffer's output pair with int64
atomics (`add_sums`). Wrapping integer arithmetic is associative, so the order programs and
lanes add in never changes the result. Imported only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl


# Triton reads the signature: no Python annotations inside the kernels' helpers.
@triton.jit
def add_words(acc0, acc1, x, first, offs):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """The lanes' running (S0, S1) after words `x` at word indices `first + offs` (`first`:
    where the words' run starts in the buffer, 0 when `offs` already counts from its
    start; a masked lane loads 0 and adds nothing)."""
    return acc0 + x, acc1 + x * (first + offs)


@triton.jit
def tail_word(tail_bytes, lane):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """The value of a last partial word: `tail_bytes` (8 lanes, the ones past the buffer
    loaded as 0) read little-endian, zero-padded like the torch reference."""
    return tl.sum(tail_bytes.to(tl.int64) << (lane * 8), axis=0)


@triton.jit
def add_sums(out, acc0, acc1, tail, tail_index):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """Add the lanes' (S0, S1), and a tail word `tail` at word index `tail_index` (0 for
    none), into the int64 pair at `out` (atomically: many programs share one pair)."""
    tl.atomic_add(out, tl.sum(acc0, axis=0) + tail)
    tl.atomic_add(out + 1, tl.sum(acc1, axis=0) + tail * tail_index)
