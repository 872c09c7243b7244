"""The Triton kernels that accumulate checksum sums (`checksum.py`'s, `copy_sums.py`'s copy
that checksums, `chunk_copy.py`'s pack that checksums, all three through `triton_sums`; and
`delta_batch.py`'s sender scan, which sums a block in one pass of its own) give these exact
(S0, S1) values for fixed bytes, in Triton's interpreter: pinned numbers, not a comparison
with the torch reference (the other tests do that), so a change to the shared accumulation
that moved any kernel's result by one bit fails here even if the reference moved with it.

The bytes are a fixed arithmetic pattern (no random generator whose stream could change);
the sizes cover a partial last word, empty and one-byte buffers, and buffers spanning
several programs; every output row starts nonzero, since the kernels add into it.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.unit.reshard.interpreter import run_in_interpreter

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

# What the kernels left in their output rows on main before the accumulation was shared
# (one (S0, S1) pair per buffer, int64), and the delta scan's on main at c3db6fc. The
# checksum and the copy that checksums sum the same nine buffers into rows that start the
# same: the same rows.
_NINE_BUFFERS = [
    [143, 1000008],
    [16521466388619428, 3000014],
    [5531618506063951028, 5000020],
    [-3002832511014067161, 502189568312],
    [8000029, 9000032],
    [5424383760090853430, -7787112127123931341],
    [8172737404789729211, -6170057104554601973],
    [6255587612562322624, -3825857995778558981],
    [5314855182363724685, -6765953681610529491],
]
PINNED: dict[str, list[list[int]]] = {
    "checksum": _NINE_BUFFERS,
    "copy_sums": _NINE_BUFFERS,
    "chunk_copy": [
        [-2108366966105667423, 7838963014211568503],
        [-401402709163365273, -4179512524163723911],
    ],
    "delta_scan": [
        [-7343243383487235594, 1000008],
        [101296111100371599, 6467231320852118826],
        [-2380986742580809573, 6619656570030783161],
        [5864089744333691513, -4846543615302901053],
    ],
}


def sums_of_every_kernel(device: str) -> dict[str, list[list[int]]]:
    """Each kernel's output rows for the fixed inputs (run in a Triton interpreter)."""
    import torch

    from refitplane.reshard import checksum, chunk_copy, copy_sums

    dev = torch.device(device)
    per_program = 8 * checksum._WORDS_PER_PROGRAM

    def pattern(n: int, salt: int) -> torch.Tensor:
        index = torch.arange(n, dtype=torch.int64)
        return ((index * 131 + salt * 7919 + (index >> 9) * 17) % 251).to(torch.uint8).to(dev)

    def start_rows(count: int) -> torch.Tensor:
        rows = torch.arange(2 * count, dtype=torch.int64).reshape(count, 2) * 1_000_003 + 5
        return rows.to(dev)

    sizes = (1, 7, 8, 13, 0, per_program + 3, 2 * per_program, 3 * per_program - 5, 24)
    bufs = [pattern(n, 1 + i) for i, n in enumerate(sizes)]
    out: dict[str, list[list[int]]] = {}

    # checksum.py: one launch over every buffer.
    rows = start_rows(len(bufs))
    checksum._launch(checksum._triton_kernel(), bufs, list(rows.unbind(0)))
    out["checksum"] = rows.tolist()

    # copy_sums.py: copies each buffer into an 8-byte aligned target, summing as it copies.
    rows = start_rows(len(bufs))
    targets = [torch.zeros(n + 8, dtype=torch.uint8, device=dev)[8:] for n in sizes]
    copy_sums.CopySums(list(zip(targets, bufs, strict=True)), list(rows.unbind(0))).launch()
    for dst, src in zip(targets, bufs, strict=True):
        assert torch.equal(dst, src), src.numel()
    out["copy_sums"] = rows.tolist()

    # chunk_copy.py: packs whole words back to back into one message, summing as it packs.
    messages = []
    for salt, chunk_sizes in enumerate(((8, 3 * per_program, 16, 0, 24), (per_program, 8))):
        chunks = [pattern(n, 100 + salt + i) for i, n in enumerate(chunk_sizes)]
        offsets = [sum(chunk_sizes[:i]) for i in range(len(chunk_sizes))]
        messages.append((chunks, offsets))
    tables = chunk_copy.build_tables(messages, dev)
    rows = start_rows(len(messages))
    for (chunks, offsets), table, row in zip(messages, tables, rows.unbind(0), strict=True):
        assert table.whole_words
        message = torch.zeros(offsets[-1] + chunks[-1].numel() + 16, dtype=torch.uint8)
        message = message.to(dev)[: offsets[-1] + chunks[-1].numel()]
        chunk_copy.launch(table, message, scatter=False, sums=row)
        assert torch.equal(message, torch.cat(chunks))
    out["chunk_copy"] = rows.tolist()

    # delta_batch.py: the sender's scan of current against base images (2-byte words), whose
    # pass also sums each current image (whole 8-byte words; blocks of 4096 words, so the
    # largest spans three programs).
    from refitplane.reshard import delta_batch

    scan_sizes = (8, 24, 8000, 2 * 8192 + 16)
    currents = [pattern(n, 200 + i) for i, n in enumerate(scan_sizes)]
    bases = [pattern(n, 300 + i) for i, n in enumerate(scan_sizes)]
    rows = start_rows(len(currents))
    batch = delta_batch.scan_many(currents, bases, 2, update=False, sums=list(rows.unbind(0)))
    assert all(batch.summed)
    out["delta_scan"] = rows.tolist()
    return out


def check_pinned(device: str) -> None:
    """Every kernel's rows equal `PINNED` (printed as found, to pin them)."""
    found = sums_of_every_kernel(device)
    print(found)
    assert found == PINNED, found


def test_every_sums_kernel_gives_the_pinned_sums_in_the_interpreter() -> None:
    run_in_interpreter("tests.unit.reshard.test_sums_kernels_pinned", "check_pinned")
