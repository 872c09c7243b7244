"""The Triton checksum kernel computes exactly what the torch reference does."""

from __future__ import annotations

import pytest
import torch

from refitplane.reshard import checksum as cs

pytestmark = [pytest.mark.gpu(count=1)]


@pytest.mark.parametrize("n", [1, 8, 13, 16 * 1024 * 8 + 5, cs._SLAB * 8 * 3 + 7, 1 << 30])
def test_triton_equals_torch(n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
    fast = cs.checksum(buf)
    slow = cs.checksum(buf, use_triton=False)
    assert cs._triton_kernel() is not None
    assert int(fast) == int(slow)
    if n <= 1 << 26:
        assert int(cs.checksum(buf.cpu())) == int(fast)  # and the CPU path agrees


def test_one_launch_for_many_buffers_equals_torch() -> None:
    """A group's buffers in one call: 8-byte aligned ones (any length, partial last words
    included) share one launch, odd offsets take the torch path; every row gets exactly
    its buffer's sums."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    arena = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda", generator=gen)
    spans = [(0, 8), (64, 1 << 20), (3, 4096), (1 << 21, 5), (1 << 22, 24 << 20), (100, 0)]
    bufs = [arena[o : o + n] for o, n in spans]
    table = torch.zeros((len(bufs), 2), dtype=torch.int64, device="cuda")
    cs.accumulate_sums_many(bufs, [table[i] for i in range(len(bufs))])
    cs.accumulate_sums_many(bufs[:2], [table[0], table[1]])  # it adds
    for i, buf in enumerate(bufs):
        ref = torch.zeros(2, dtype=torch.int64, device="cuda")
        cs.accumulate_sums(buf, ref, use_triton=False)
        if i < 2:
            ref = ref * 2
        assert table[i].tolist() == ref.tolist(), (i, spans[i])


def test_reserved_launch_tables_serve_a_whole_transfer() -> None:
    """Groups launched through a transfer's reserved tables (no allocation while NCCL runs)
    sum like the torch path; a table that would overflow its reservation is refused."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    bufs = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
        for n in (8 << 20, 1 << 20, 4096, 24 << 20)
    ]
    tables = cs.LaunchTables(torch.device("cuda"), entries=len(bufs))
    rows = torch.zeros((len(bufs), 2), dtype=torch.int64, device="cuda")
    cs.accumulate_sums_many(bufs[:2], [rows[0], rows[1]], tables=tables)
    cs.accumulate_sums_many(bufs[2:], [rows[2], rows[3]], tables=tables)
    for i, buf in enumerate(bufs):
        ref = torch.zeros(2, dtype=torch.int64, device="cuda")
        cs.accumulate_sums(buf, ref, use_triton=False)
        assert rows[i].tolist() == ref.tolist(), i
    with pytest.raises(RuntimeError, match="tables full"):
        cs.accumulate_sums_many(bufs[:1], [rows[0]], tables=tables)
    tables.reset()
    cs.accumulate_sums_many(bufs[:1], [rows[0]], tables=tables)


def test_any_group_size_reuses_the_one_loaded_kernel() -> None:
    """After `LaunchTables` (before a transfer starts), no group size compiles or loads
    another kernel variant: module loading inside a transfer can deadlock two ranks."""
    device = torch.device("cuda")
    tables = cs.LaunchTables(device, entries=200)
    kernel = cs._triton_kernel()
    compiled = len(kernel.device_caches[torch.cuda.current_device()][0])
    arena = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device=device)
    rows = torch.zeros((64, 2), dtype=torch.int64, device=device)
    for count in (1, 2, 3, 16, 17, 33, 64):
        bufs = [arena[i * 4096 : i * 4096 + 1000 + 8 * i] for i in range(count)]
        cs.accumulate_sums_many(bufs, [rows[i] for i in range(count)], tables=tables)
    torch.cuda.synchronize()
    assert len(kernel.device_caches[torch.cuda.current_device()][0]) == compiled
