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
    "n", [1, 7, 8, 9, 4096 * 8, 4096 * 8 + 5, (cs._SLAB + 4096 * 3 + 1) * 8 + 3]
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


def test_checksum_matches_its_definition() -> None:
    """S0 = sum(x_i), S1 = sum(i * x_i) over little-endian words, tail zero-padded."""
    buf = _bytes(8 * 5 + 3, seed=9)
    words = [
        int.from_bytes(bytes(buf[i : i + 8].tolist()), "little", signed=True)
        for i in range(0, 40, 8)
    ]
    words.append(int.from_bytes(bytes(buf[40:].tolist()) + bytes(5), "little", signed=True))
    mask = (1 << 64) - 1
    s0 = sum(words) & mask
    s1 = sum(i * w for i, w in enumerate(words)) & mask
    want = (s1 * (cs._A & mask) + s0 * cs._B + 43 * cs._C) & mask
    assert int(cs.checksum(buf)) & mask == want


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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 1), st.integers(1, 700)), max_size=80))
def test_ring_never_overlaps_live_slices(ops: list[tuple[int, int]]) -> None:
    """Takes and out-of-order releases: no live slice ever overlaps another."""
    ring = StagingRing(2048, torch.device("cpu"))
    live: dict[int, tuple[int, int]] = {}
    for action, n in ops:
        if action < 0 and live:
            token = sorted(live)[(-action - 1) % len(live)]  # not always the oldest
            ring.release(token)
            del live[token]
            continue
        got = ring.try_take(n)
        if got is None:
            assert live, "an empty ring must always have room"
            continue
        token, view, _ = got
        start = view.data_ptr() - ring.buffer.data_ptr()
        span = (start, start + n)
        assert span[1] <= 2048
        for a, b in live.values():
            assert span[1] <= a or b <= span[0], (span, live)
        live[token] = span
    assert ring.peak <= 2048


def test_ring_rejects_oversized_messages() -> None:
    with pytest.raises(InvalidArgument, match="exceeds the staging ring"):
        StagingRing(100, torch.device("cpu")).try_take(101)


def test_space_given_back_early_is_followed_by_its_next_taker() -> None:
    """A slice released with `after` (still in use on the device) goes to the next taker at
    once, with `after` to follow; space a new slice covers is followed through it only."""
    ring = StagingRing(1024, torch.device("cpu"))
    a, _, follow_a = ring.try_take(512) or (0, None, ())
    b, _, _ = ring.try_take(512) or (0, None, ())
    assert follow_a == ()
    assert ring.try_take(256) is None  # full: nothing given back yet
    ring.release(a, after="group-a")
    c, _, follow_c = ring.try_take(256) or (0, None, ())
    assert follow_c == ("group-a",)  # [0, 256) of a's space, still in use on the device
    d, _, follow_d = ring.try_take(256) or (0, None, ())
    assert follow_d == ("group-a",)  # [256, 512): a's space again
    ring.release(b, after="group-b")
    ring.release(c, after="group-c")
    ring.release(d)  # completed on the host: nothing to follow
    e, _, follow_e = ring.try_take(1024) or (0, None, ())
    # a's space went to c and d (whose own release follows it); d came back done; b's and
    # c's space remain to follow.
    assert set(follow_e) == {"group-b", "group-c"}
    ring.release(e, after="group-e")
    ring.settled()  # a drained transfer: nothing left to follow
    assert ring.try_take(1024) is not None
    assert ring.try_take(8) is None
