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

The data plane checksums hundreds of messages per refit, so the per-message host cost
matters as much as the kernel: `accumulate_sums` adds a buffer's (S0, S1) into one row of
a preallocated table with a single kernel launch (the kernel's blocks add their partial
sums atomically), and both ends compare tables. `checksum` folds (S0, S1, n) into one
value for everything else.
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
    """Compile-on-first-use Triton kernel, or None where Triton cannot run. It adds a
    buffer's (S0, S1) straight into `out_ptr[0:2]` (int64 atomics, one per block): one
    launch per buffer, no partial sums to reduce."""
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
    def _sums_into(x_ptr, n_words, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
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
        tl.atomic_add(out_ptr, tl.sum(acc0, axis=0))
        tl.atomic_add(out_ptr + 1, tl.sum(acc1, axis=0))

    _kernel = _sums_into
    return _kernel


def _launch(kernel: Any, words: torch.Tensor, out: torch.Tensor) -> None:
    programs = -(-words.numel() // (_BLOCK * _ITERS))
    kernel[(programs,)](words, words.numel(), out, BLOCK=_BLOCK, ITERS=_ITERS)


def _sums_triton(words: torch.Tensor, kernel: Any) -> tuple[torch.Tensor, torch.Tensor]:
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    _launch(kernel, words, sums)
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


def accumulate_sums(buf: torch.Tensor, out: torch.Tensor, *, use_triton: bool = True) -> None:
    """Add (S0, S1) of a contiguous 1-D uint8 tensor into `out`, an int64 tensor of two
    elements on the buffer's device (a row of a zeroed table). Asynchronous on CUDA."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("checksum needs a contiguous 1-D uint8 tensor")
    n = buf.numel()
    nwords = n // 8
    device = buf.device
    if nwords and buf.storage_offset() % 8:
        # int64 views need 8-byte alignment; the schedule aligns chunks, so this is rare.
        buf = buf.clone()
    if nwords:
        words = buf[: nwords * 8].view(torch.int64)
        kernel = _triton_kernel() if use_triton and device.type == "cuda" else None
        if kernel is not None and out.is_contiguous():
            _launch(kernel, words, out)
        else:
            s0, s1 = _sums_triton(words, kernel) if kernel is not None else _sums_torch(words)
            out += torch.stack((s0, s1))
    if n % 8:
        tail = buf[nwords * 8 :].to(torch.int64)
        shifts = torch.arange(0, 8 * tail.numel(), 8, dtype=torch.int64, device=device)
        last = (tail << shifts).sum()
        out += torch.stack((last, last * nwords))


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
