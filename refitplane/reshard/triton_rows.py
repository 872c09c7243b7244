"""The program → row lookup of the table-driven Triton kernels (checksums, chunk copies).

Imported only where Triton is installed (the kernels' factories import it lazily). A launch
table has 4 int64 per row, the last one the row's first program; programs of a launch map
to rows by a binary search of a fixed number of steps (a fixed depth keeps one compiled
variant whatever the table's length: surplus steps keep the found row).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
