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
"""

from __future__ import annotations

from typing import Any

import torch

_A = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants, as signed int64
_B = 0x632BE59BD9B4E019
_C = 0x2545F4914F6CDD1D
_SLAB = 1 << 20  # words per torch step: bounds its temporary memory to ~16 MiB
_BLOCK = 1024
_ITERS = 16

_kernel: Any = None


def _triton_kernel() -> Any:
    """Compile-on-first-use Triton kernel, or None where Triton cannot run."""
    global _kernel
    if _kernel is not None:
        return _kernel or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _kernel = False
        return None

    # Triton reads the signature: no Python annotations inside the kernel.
    @triton.jit  # type: ignore[untyped-decorator]
    def _sums(x_ptr, n_words, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        pid = tl.program_id(0).to(tl.int64)
        acc0 = tl.zeros([BLOCK], dtype=tl.int64)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        base = pid * BLOCK * ITERS
        for it in range(ITERS):
            offs = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < n_words
            x = tl.load(x_ptr + offs, mask=mask, other=0)
            acc0 += x
            acc1 += x * offs
        tl.store(out_ptr + pid * 2, tl.sum(acc0, axis=0))
        tl.store(out_ptr + pid * 2 + 1, tl.sum(acc1, axis=0))

    _kernel = _sums
    return _kernel


def _sums_triton(words: torch.Tensor, kernel: Any) -> tuple[torch.Tensor, torch.Tensor]:
    n = words.numel()
    programs = -(-n // (_BLOCK * _ITERS))
    partial = torch.empty((programs, 2), dtype=torch.int64, device=words.device)
    kernel[(programs,)](words, n, partial, BLOCK=_BLOCK, ITERS=_ITERS)
    sums = partial.sum(dim=0)
    return sums[0], sums[1]


def _sums_torch(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s0 = torch.zeros((), dtype=torch.int64, device=words.device)
    s1 = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _SLAB):
        seg = words[start : start + _SLAB]
        idx = torch.arange(start, start + seg.numel(), dtype=torch.int64, device=words.device)
        s0 += seg.sum()
        s1 += (seg * idx).sum()
    return s0, s1


def checksum(buf: torch.Tensor, *, use_triton: bool = True) -> torch.Tensor:
    """Checksum of a contiguous 1-D uint8 tensor, as a 0-d int64 tensor on its device."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("checksum needs a contiguous 1-D uint8 tensor")
    n = buf.numel()
    nwords = n // 8
    device = buf.device
    if nwords and buf.storage_offset() % 8:
        # int64 views need 8-byte alignment; the schedule aligns chunks, so this is rare.
        buf = buf.clone()
    s0 = torch.zeros((), dtype=torch.int64, device=device)
    s1 = torch.zeros((), dtype=torch.int64, device=device)
    if nwords:
        words = buf[: nwords * 8].view(torch.int64)
        kernel = _triton_kernel() if use_triton and device.type == "cuda" else None
        s0, s1 = _sums_triton(words, kernel) if kernel is not None else _sums_torch(words)
    if n % 8:
        tail = buf[nwords * 8 :].to(torch.int64)
        shifts = torch.arange(0, 8 * tail.numel(), 8, dtype=torch.int64, device=device)
        last = (tail << shifts).sum()
        s0 = s0 + last
        s1 = s1 + last * nwords
    length_term = (n * _C) & ((1 << 64) - 1)
    if length_term >= 1 << 63:
        length_term -= 1 << 64
    return s1 * _A + s0 * _B + length_term


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """Checksum of any contiguous tensor's bytes."""
    return checksum(t.reshape(-1).view(torch.uint8))
