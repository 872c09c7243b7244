from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitplane.errors import InvalidArgument
from refitplane.reshard import checksum as cs
from refitplane.reshard.staging import StagingRing

pytestmark = pytest.mark.unit


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )


@pytest.mark.parametrize(
    "n", [1, 7, 8, 9, 4096 * 8, 4096 * 8 + 5, (cs._SLAB_WORDS + 4096 * 3 + 1) * 8 + 3]
)
def test_checksum_detects_corruption(n: int) -> None:
    buf = _bytes(n)
    ref = cs.checksum(buf)
    assert torch.equal(cs.checksum(buf.clone()), ref)
    flipped = buf.clone()
    flipped[n // 2] ^= 1
    assert not torch.equal(cs.checksum(flipped), ref)
    if n >= 16:
        swapped = buf.clone()
        swapped[:8], swapped[8:16] = buf[8:16].clone(), buf[:8].clone()
        if not torch.equal(swapped, buf):
            assert not torch.equal(cs.checksum(swapped), ref)
    if n > 1:
        assert not torch.equal(cs.checksum(buf[:-1]), ref)


def test_checksum_sees_row_swaps_and_transposes() -> None:
    words = _bytes(8 * 4096 * 4, seed=3)
    rows = words.view(4, -1)
    swapped = torch.cat([rows[1], rows[0], rows[2], rows[3]])
    assert not torch.equal(cs.checksum(swapped), cs.checksum(words))
    m = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(cs.checksum_tensor(m), cs.checksum_tensor(m.t().contiguous()))


def test_checksum_is_independent_of_alignment() -> None:
    buf = _bytes(1000, seed=5)
    backing = torch.zeros(1003, dtype=torch.uint8)
    backing[3:].copy_(buf)
    assert torch.equal(cs.checksum(backing[3:]), cs.checksum(buf))


def test_checksum_rejects_non_bytes() -> None:
    with pytest.raises(ValueError, match="uint8"):
        cs.checksum(torch.zeros(4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700)), max_size=60))
def test_ring_never_overlaps_live_slices(ops: list[tuple[bool, int]]) -> None:
    ring = StagingRing(2048, torch.device("cpu"))
    live: list[tuple[int, int]] = []
    for release, n in ops:
        if release and live:
            ring.release_oldest()
            live.pop(0)
            continue
        got = ring.try_take(n)
        if got is None:
            assert live, "an empty ring must always have room"
            continue
        start = got.data_ptr() - ring.buffer.data_ptr()
        span = (start, start + n)
        assert span[1] <= 2048
        for a, b in live:
            assert span[1] <= a or b <= span[0], (span, live)
        live.append(span)
    assert ring.peak <= 2048


def test_ring_rejects_oversized_messages() -> None:
    with pytest.raises(InvalidArgument, match="exceeds the staging budget"):
        StagingRing(100, torch.device("cpu")).try_take(101)
