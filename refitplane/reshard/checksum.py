"""Position-sensitive checksums of byte buffers, computed on the buffer's own device.

The sender checksums each message it sends, the receiver what it received (in parameter
memory when the message went there directly); equal sums prove the destination got
exactly the source's bytes. The buffer is read as little-endian 64-bit words `x_i`
(the last 1-7 bytes, zero-padded, form one more word), and

    S0 = sum(x_i)          S1 = sum(i * x_i)          (both mod 2^64)
    checksum = A*S1 + B*S0 + C*n_bytes                 (mod 2^64)

The index weight makes swapped, shifted or transposed data change the sum; wrapping
integer arithmetic is associative, so any reduction order gives the same value. On CUDA a
Triton kernel computes S0 and S1 in one pass at memory bandwidth; elsewhere (and as the
reference) torch does it in bounded slabs. Results stay on the device (no host sync).

The data plane checksums hundreds of messages per refit, so the host cost matters as much
as the kernel: `accumulate_sums_many` adds each buffer's (S0, S1) into its row of a
preallocated table with a single kernel launch for a whole group of messages (the
kernel's blocks add their partial sums atomically), and both ends compare tables.
`checksum` folds (S0, S1, n) into one value for everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from refitplane.reshard.triton_load import load_kernel

_A = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants, as signed int64
_B = 0x632BE59BD9B4E019
_C = 0x2545F4914F6CDD1D
_SLAB = 1 << 20  # words per torch step: bounds its temporary memory to ~16 MiB
_BLOCK = 1024
_ITERS = 16
_WORDS_PER_PROGRAM = _BLOCK * _ITERS
# Binary-search steps in every launch: one kernel variant for any table up to 2^20 rows
# (surplus steps keep the found row).
_SEARCH_STEPS = 20


def _triton_kernel() -> Any:
    """The kernel (`checksum_kernel.py`, compiled on first launch), or None where Triton
    cannot run."""
    return load_kernel("refitplane.reshard.checksum_kernel", "sums_into")


class LaunchTables:
    """Room for the launch tables of one transfer, allocated before it starts.

    While NCCL kernels are in flight, the data plane must not allocate page-locked host
    memory or device memory: CUDA serializes streams around both, and a rank whose next
    transfer cannot start while an earlier one waits for a peer deadlocks with that peer.
    So a transfer reserves room for every table it will upload (one entry per message) up
    front, and each group's table goes to its own slice (pinned host → device, async).
    Constructing one also compiles and loads the kernel, its only variant (module loading
    blocks while kernels run: a compile in the middle of a transfer deadlocked the 4.25 GiB
    strided two-GPU case when each table size had its own variant)."""

    def __init__(self, device: torch.device, entries: int) -> None:
        self.capacity = 4 * max(1, entries)
        self.host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
        self.device_table = torch.empty(self.capacity, dtype=torch.int64, device=device)
        self.used = 0
        kernel = _triton_kernel()
        if kernel is not None:
            probe = torch.zeros(3, dtype=torch.int64, device=device)
            _launch_table(kernel, [probe.data_ptr(), 8, probe[1:].data_ptr(), 0], 1, device, self)
            torch.cuda.current_stream(device).synchronize()
            self.reset()

    def reset(self) -> None:
        """Start a new transfer (the previous one has completed)."""
        self.used = 0

    def upload(self, table: list[int]) -> torch.Tensor:
        """`table` on the device, in this transfer's next free slice (no allocation)."""
        n = len(table)
        if self.used + n > self.capacity:
            raise RuntimeError(
                f"checksum launch tables full ({self.capacity // 4} entries reserved)"
            )
        host = self.host[self.used : self.used + n]
        host.copy_(torch.tensor(table, dtype=torch.int64))
        dev = self.device_table[self.used : self.used + n]
        dev.copy_(host, non_blocking=True)
        self.used += n
        return dev


def _launch_table(
    kernel: Any,
    table: list[int],
    programs: int,
    device: torch.device,
    tables: LaunchTables | None = None,
) -> None:
    """One launch over `table` (4 ints per buffer, see `checksum_kernel`), uploaded through
    the transfer's reserved `tables`, or (outside transfers) as a fresh device copy."""
    entries = len(table) // 4
    if entries >= 1 << _SEARCH_STEPS:
        raise ValueError(f"one checksum launch takes under {1 << _SEARCH_STEPS} buffers")
    if tables is not None:
        table_dev = tables.upload(table)
    else:
        table_dev = torch.tensor(table, dtype=torch.int64).to(device)
    kernel[(programs,)](table_dev, entries, BLOCK=_BLOCK, ITERS=_ITERS, STEPS=_SEARCH_STEPS)


def _table(bufs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """The launch table for 8-byte aligned 1-D uint8 `bufs` summing into `outs`, and how
    many programs cover them (empty buffers get no row)."""
    table: list[int] = []
    programs = 0
    for buf, out in zip(bufs, outs, strict=True):
        n = buf.numel()
        if n:
            table += [buf.data_ptr(), n, out.data_ptr(), programs]
            programs += -(-n // (8 * _WORDS_PER_PROGRAM))  # words, a partial last one too
    return table, programs


def _launch(kernel: Any, bufs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """Add each 8-byte aligned 1-D uint8 `bufs[i]`'s (S0, S1) into `outs[i]` (two contiguous
    int64), one launch."""
    table, programs = _table(bufs, outs)
    if programs:
        _launch_table(kernel, table, programs, bufs[0].device)


def _sums_torch(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s0 = torch.zeros((), dtype=torch.int64, device=words.device)
    s1 = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _SLAB):
        seg = words[start : start + _SLAB]
        idx = torch.arange(start, start + seg.numel(), dtype=torch.int64, device=words.device)
        s0 += seg.sum()
        s1 += (seg * idx).sum()
    return s0, s1


def _accumulate_torch(buf: torch.Tensor, out: torch.Tensor) -> None:
    """The reference path (any device, any alignment, any length)."""
    n = buf.numel()
    nwords = n // 8
    if nwords and buf.storage_offset() % 8:
        buf = buf.clone()  # int64 views need 8-byte alignment
    if nwords:
        s0, s1 = _sums_torch(buf[: nwords * 8].view(torch.int64))
        out += torch.stack((s0, s1))
    if n % 8:
        tail = buf[nwords * 8 :].to(torch.int64)
        shifts = torch.arange(0, 8 * tail.numel(), 8, dtype=torch.int64, device=buf.device)
        last = (tail << shifts).sum()
        out += torch.stack((last, last * nwords))


def _split(
    kernel: Any, bufs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(buffer, row) pairs the kernel takes (8-byte aligned, on one CUDA device), and the
    rest (the torch path)."""
    fast: list[tuple[torch.Tensor, torch.Tensor]] = []
    slow: list[tuple[torch.Tensor, torch.Tensor]] = []
    for buf, out in zip(bufs, outs, strict=True):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError("checksum needs a contiguous 1-D uint8 tensor")
        if (
            kernel is not None
            and buf.is_cuda
            and not buf.data_ptr() % 8
            and out.is_contiguous()
            and (not fast or buf.device == fast[0][0].device)
        ):
            fast.append((buf, out))
        else:
            slow.append((buf, out))
    return fast, slow


def accumulate_sums_many(
    bufs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    use_triton: bool = True,
    tables: LaunchTables | None = None,
) -> None:
    """Add (S0, S1) of each contiguous 1-D uint8 `bufs[i]` into `outs[i]`, an int64 tensor of
    two elements on the buffer's device (a row of a zeroed table). Asynchronous on CUDA,
    where every 8-byte aligned buffer (every message the schedule cuts, unless a parameter
    view itself starts off a word) goes into one kernel launch; anything else takes the
    torch path. Called once per group of messages, so the per-buffer work here is a
    handful of attribute reads. Inside a transfer, pass its `LaunchTables` (see there why)."""
    kernel = _triton_kernel() if use_triton else None
    fast, slow = _split(kernel, bufs, outs)
    for buf, out in slow:
        _accumulate_torch(buf, out)
    table, programs = _table([b for b, _ in fast], [o for _, o in fast])
    if programs:
        _launch_table(kernel, table, programs, fast[0][0].device, tables)


class PreparedSums:
    """`accumulate_sums_many` over buffers and rows whose memory stays the same from one
    launch to the next (a CUDA IPC link's chunks, refit after refit): the launch table is
    uploaded once, so a launch costs no host work per buffer."""

    def __init__(self, bufs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        self._kernel = _triton_kernel()
        fast, self._slow = _split(self._kernel, bufs, outs)
        table, self._programs = _table([b for b, _ in fast], [o for _, o in fast])
        self._entries = len(table) // 4
        self._table = (
            torch.tensor(table, dtype=torch.int64).to(fast[0][0].device) if self._programs else None
        )
        self._keep = fast  # the table points into these

    def launch(self) -> None:
        """Add every buffer's sums into its row (asynchronous on CUDA)."""
        for buf, out in self._slow:
            _accumulate_torch(buf, out)
        if self._table is not None:
            self._kernel[(self._programs,)](
                self._table, self._entries, BLOCK=_BLOCK, ITERS=_ITERS, STEPS=_SEARCH_STEPS
            )


def accumulate_sums(buf: torch.Tensor, out: torch.Tensor, *, use_triton: bool = True) -> None:
    """`accumulate_sums_many` for one buffer."""
    accumulate_sums_many([buf], [out], use_triton=use_triton)


def fold_sums(sums: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The checksum of a buffer of `nbytes` whose (S0, S1) are `sums`, as a 0-d int64."""
    length_term = (nbytes * _C) & ((1 << 64) - 1)
    if length_term >= 1 << 63:
        length_term -= 1 << 64
    return sums[1] * _A + sums[0] * _B + length_term


def checksum(buf: torch.Tensor, *, use_triton: bool = True) -> torch.Tensor:
    """Checksum of a contiguous 1-D uint8 tensor, as a 0-d int64 tensor on its device."""
    sums = torch.zeros(2, dtype=torch.int64, device=buf.device)
    accumulate_sums(buf, sums, use_triton=use_triton)
    return fold_sums(sums, buf.numel())


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """Checksum of any contiguous tensor's bytes."""
    return checksum(t.reshape(-1).view(torch.uint8))
