"""Position-sensitive checksums of byte buffers, computed on the buffer's own device.

The sender checksums what it sends, the receiver what landed in its parameters; equal sums
prove the destination holds exactly the source's bytes. The sum weights every 8-byte word
by a pseudo-random odd factor that depends on its position (word index within a row of
`_ROW` words, and the row index), so swapped, shifted, truncated or transposed data all
change it; integer arithmetic wraps mod 2^64 identically on every device.

Work is done in slabs so the temporary memory stays small (`_SLAB_WORDS` * 8 bytes),
independent of the buffer size; the result stays on the device (no host sync).
"""

from __future__ import annotations

import torch

_ROW = 1 << 12
_SLAB_WORDS = 1 << 20
# Odd 64-bit constants (golden ratio and a splitmix64 step), as signed int64.
_MUL_A = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL_B = 0x632BE59BD9B4E019
_LEN = 0x2545F4914F6CDD1D

_weights: dict[torch.device, torch.Tensor] = {}


def _word_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        gen = torch.Generator().manual_seed(0x5EED)
        raw = torch.randint(-(1 << 62), 1 << 62, (_ROW,), generator=gen, dtype=torch.int64)
        w = (raw * 2 + 1).to(device)
        _weights[device] = w
    return w


def _row_weights(first: int, count: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(first, first + count, device=device, dtype=torch.int64)
    return (idx * _MUL_A + _MUL_B) | 1


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """Checksum of a contiguous 1-D uint8 tensor, as a 0-d int64 tensor on its device."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("checksum needs a contiguous 1-D uint8 tensor")
    device = buf.device
    n = buf.numel()
    acc = torch.full((), n * _LEN & ((1 << 63) - 1), dtype=torch.int64, device=device)
    nwords = n // 8
    if nwords and buf.storage_offset() % 8:
        # int64 views need 8-byte alignment; the schedule aligns chunks, so this is rare.
        buf = buf.clone()
    if nwords:
        words = buf[: nwords * 8].view(torch.int64)
        w = _word_weights(device)
        full_rows = nwords // _ROW
        slab_rows = _SLAB_WORDS // _ROW
        for r0 in range(0, full_rows, slab_rows):
            r1 = min(full_rows, r0 + slab_rows)
            rows = words[r0 * _ROW : r1 * _ROW].view(-1, _ROW)
            acc += ((rows * w).sum(dim=1) * _row_weights(r0, r1 - r0, device)).sum()
        tail = words[full_rows * _ROW :]
        if tail.numel():
            acc += (tail * w[: tail.numel()]).sum() * _row_weights(full_rows, 1, device)[0]
    rest = buf[nwords * 8 :]
    if rest.numel():
        acc += (rest.to(torch.int64) * _row_weights(1 << 40, rest.numel(), device)).sum()
    return acc


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """Checksum of any contiguous tensor's bytes."""
    return checksum(t.reshape(-1).view(torch.uint8))
