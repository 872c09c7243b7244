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
