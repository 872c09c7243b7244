"""Copies that checksum what they copy: one Triton launch copies many contiguous byte chunks
(source → destination, both 8-byte aligned, on one device) and adds each chunk's (S0, S1),
as `checksum.py` defines them over the chunk's bytes, into the chunk's row.

A CUDA IPC receiver (`ipc_run.py`) copies every chunk of a link out of the sender's memory
straight into its parameters; checksumming the destination afterwards would read every
byte again (on one GPU: a third of the copy's traffic once more). Here the sums come from
the words in registers as they are written: one read, one write per byte. The table (one
row per chunk: first program, source, destination, bytes, output row) is built once per
set of chunks and reused by every refit that copies the same memory; like the other
table-driven kernels, each program finds its row by a binary search of fixed depth and
nothing varying is specialized, so one variant is compiled per alignment, before the first
copy: where every chunk of a launch starts 16-byte aligned on both ends (nearly always:
parameters whole or cut at row boundaries) the kernel is told so and moves 16 bytes per
access, unmasked but in each chunk's last program; else 8 bytes at a time, masked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from refitplane.reshard.triton_load import launch_setting, load_kernel

# The launch shape: words per step of a program, steps per program, warps per program
# (settable for measuring it, `benchmarks/copy_sums_gpu.py`; read at import).
_BLOCK = launch_setting("REFIT_COPY_SUMS_BLOCK", 1024, 64, 16384)
_ITERS = launch_setting("REFIT_COPY_SUMS_ITERS", 16, 1, 256)
_WARPS = launch_setting("REFIT_COPY_SUMS_WARPS", 4, 1, 32)
_BYTES_PER_PROGRAM = 8 * _BLOCK * _ITERS
_SEARCH_STEPS = 20
_ROW = 5
# Launches whose chunks are all 16-byte aligned on both ends tell the kernel so (16-byte
# accesses, unmasked but for each chunk's last program); REFIT_COPY_SUMS_ALIGNED=0: never
# (to compare; read at each launch).
ALIGNED = os.environ.get("REFIT_COPY_SUMS_ALIGNED", "1") != "0"


def triton_kernel() -> Any:
    """The kernel (`copy_sums_kernel.py`, compiled on first launch), or None where Triton
    cannot run."""
    return load_kernel("refitplane.reshard.copy_sums_kernel", "copy_sums")


def eligible(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the kernel can copy 1-D byte `src` into `dst`: one device (a peer GPU's
    memory goes through `copy_` and the copy engines), 8-byte aligned, Triton available."""
    return (
        dst.device == src.device
        and not dst.data_ptr() % 8
        and not src.data_ptr() % 8
        and dst.numel() == src.numel()
        and triton_kernel() is not None
    )


class CopySums:
    """`pairs[i]` = (dst, src): contiguous 1-D uint8 tensors of one device; `rows[i]`: the
    int64 pair (in a zeroed table) that chunk i's (S0, S1) are added into. Build once,
    `launch` every refit (the addresses must stay the same: the caller keeps the tensors)."""

    def __init__(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[torch.Tensor]
    ) -> None:
        table: list[int] = []
        programs = 0
        aligned = True
        for (dst, src), out in zip(pairs, rows, strict=True):
            n = dst.numel()
            if n:
                aligned &= not (src.data_ptr() % 16 or dst.data_ptr() % 16)
                table += [programs, src.data_ptr(), dst.data_ptr(), n, out.data_ptr()]
                programs += -(-n // _BYTES_PER_PROGRAM)
        self.entries = len(table) // _ROW
        if self.entries >= 1 << _SEARCH_STEPS:
            raise ValueError(f"one copy launch takes under {1 << _SEARCH_STEPS} chunks")
        self.programs = programs
        # Every chunk starts 16-byte aligned on both ends (vLLM's and the trainer's
        # parameters, whole or cut at row boundaries, nearly always are).
        self.aligned = aligned
        device = pairs[0][0].device if pairs else torch.device("cpu")
        self.table = torch.tensor(table or [0] * _ROW, dtype=torch.int64).to(device)
        # Keep the memory the table points at alive as long as the table.
        self._keep = (list(pairs), list(rows))

    def launch(self, *, aligned: bool | None = None) -> None:
        """Copy every chunk and add its sums, on the current stream (asynchronous).
        `aligned`: False runs the kernel as if some chunk were not 16-byte aligned (tests);
        None: as the chunks are, unless `ALIGNED` is off."""
        if not self.programs:
            return
        use_aligned = self.aligned and (ALIGNED if aligned is None else aligned)
        triton_kernel()[(self.programs,)](
            self.table,
            self.entries,
            BLOCK=_BLOCK,
            ITERS=_ITERS,
            STEPS=_SEARCH_STEPS,
            ROW=_ROW,
            ALIGNED=use_aligned,
            num_warps=_WARPS,
        )


def check(device: str) -> None:
    """The kernel's bytes and sums equal `copy_` and `checksum.py`'s reference (run by the
    unit tests in Triton's interpreter, and on a GPU by tests/gpu)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(11)
    sizes = (8, 13, 0, 1, _BYTES_PER_PROGRAM + 5, 2 * _BYTES_PER_PROGRAM, 24, 3)
    pool = torch.randint(0, 256, (sum(sizes) + 16 * len(sizes),), dtype=torch.uint8, generator=gen)
    pool = pool.to(dev)
    target = torch.full_like(pool, 0xA5)
    pairs, at = [], 0
    for n in sizes:
        pairs.append((target[at : at + n], pool[at : at + n]))
        at += (n + 15) // 16 * 16
    rows = torch.zeros((len(sizes), 2), dtype=torch.int64, device=dev)
    copies = CopySums(pairs, list(rows.unbind(0)))
    assert copies.aligned, "the pairs start 16-byte aligned"
    for aligned in (True, False):  # both variants of the kernel
        target.fill_(0xA5)
        rows.zero_()
        rows[1] = torch.tensor([5, 7])  # sums are added to what the row holds
        copies.launch(aligned=aligned)
        _check_copies(pairs, rows, target, f"aligned={aligned}")


def _check_copies(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    rows: torch.Tensor,
    target: torch.Tensor,
    how: str,
) -> None:
    from refitplane.reshard import checksum as cs

    expected = torch.zeros_like(rows)
    expected[1] = torch.tensor([5, 7])
    for i, (dst, src) in enumerate(pairs):
        assert torch.equal(dst, src), (how, src.numel())
        cs._accumulate_torch(src, expected[i])
    assert rows.tolist() == expected.tolist(), (how, rows.tolist(), expected.tolist())
    written = torch.zeros(target.numel(), dtype=torch.bool, device=target.device)
    for dst, _ in pairs:
        if dst.numel():
            start = dst.data_ptr() - target.data_ptr()
            written[start : start + dst.numel()] = True
    assert bool((target[~written] == 0xA5).all()), how  # nothing outside the chunks is written
