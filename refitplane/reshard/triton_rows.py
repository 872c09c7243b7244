"""The program → row lookup of the table-driven Triton kernels (checksums, chunk copies,
delta applies), the bit count of a bitmap byte and the word types (delta kernels).

Imported only where Triton is installed (the kernels' factories import it lazily). A launch
table has 4 int64 per row, the last one the row's first program; programs of a launch map
to rows by a binary search of a fixed number of steps (a fixed depth keeps one compiled
variant whatever the table's length: surplus steps keep the found row).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Triton's integer type of each word size (bytes) the delta kernels read and write.
WORD_TYPES = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


# Triton reads the signature: no Python annotations inside the kernel.
@triton.jit  # type: ignore[untyped-decorator]
def program_row(tab, n, pid, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """The address of the last row of `tab` (`n` rows) whose first program is <= `pid`."""
    lo = pid * 0
    hi = lo + n
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = tl.load(tab + mid * 4 + 3) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return tab + lo * 4


# Triton reads the signature: no Python annotations inside the kernel.
@triton.jit  # type: ignore[untyped-decorator]
def program_row_of(tab, n, pid, STEPS: tl.constexpr, ROW: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """`program_row` for a table of `ROW` int64 per row whose first column is the row's
    first program."""
    lo = pid * 0
    hi = lo + n
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = tl.load(tab + mid * ROW) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return tab + lo * ROW


@triton.jit
def popc(x):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """Set bits of each byte value (int32 in 0..255): the delta kernels' bitmap bytes."""
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F
