"""Delta encoding of a message: every encoding reproduces the sender's bytes exactly."""

from __future__ import annotations

import pytest
import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.delta import (
    DeltaHeader,
    Encoding,
    apply_delta,
    changed_words,
    choose_encoding,
    encode_into,
    encode_scanned,
    encoded_nbytes,
    scan,
    word_size,
)


def _image(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.uint8).flatten()


def _perturbed(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    current = base.clone()
    picked = torch.rand(base.shape, generator=g) < fraction
    current[picked] += torch.randn(int(picked.sum()), generator=g).to(base.dtype)
    return current


def _roundtrip(base: torch.Tensor, current: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    word = base.element_size()
    old, new = _image(base), _image(current)
    changed = int(changed_words(new, old, word))
    header = DeltaHeader(encoding, changed, encoded_nbytes(encoding, new.numel(), changed, word))
    payload = torch.full((header.nbytes,), 0xFF, dtype=torch.uint8)
    encode_into(new, old, header, word, payload)
    again = torch.zeros(header.nbytes, dtype=torch.uint8)
    encode_into(new, old, header, word, again)
    assert torch.equal(payload, again)  # no byte left over from the buffer's past
    received = old.clone()
    apply_delta(received, header, word, payload)
    return received


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("encoding", list(Encoding))
def test_every_encoding_reproduces_the_current_bytes(
    dtype: torch.dtype, fraction: float, encoding: Encoding
) -> None:
    base = torch.randn(4099, generator=torch.Generator().manual_seed(1)).to(dtype)
    current = _perturbed(base, fraction, seed=2)
    received = _roundtrip(base, current, encoding)
    assert torch.equal(received, _image(current))
    if fraction > 0:
        assert not torch.equal(received, _image(base))


def test_changes_are_bitwise() -> None:
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.float32)
    current = torch.tensor([-0.0, 1.0, float("nan"), 2.0], dtype=torch.float32)
    current.view(torch.int32)[2] ^= 1  # another NaN payload
    assert int(changed_words(_image(current), _image(base), 4)) == 2
    assert torch.equal(_roundtrip(base, current, Encoding.INDEX), _image(current))


def test_the_smallest_encoding_is_chosen_and_never_larger_than_dense() -> None:
    words = 1 << 20
    nbytes = 2 * words  # bf16
    sparse = choose_encoding(nbytes, words // 1000, 2)
    assert sparse.encoding is Encoding.INDEX
    assert sparse.nbytes < nbytes / 30
    medium = choose_encoding(nbytes, words // 5, 2)
    assert medium.encoding is Encoding.BITMAP
    assert medium.nbytes == words // 8 + 2 * (words // 5)
    assert choose_encoding(nbytes, words, 2).encoding is Encoding.DENSE
    for changed in range(0, words + 1, words // 64):
        assert choose_encoding(nbytes, changed, 2).nbytes <= nbytes


def test_word_is_the_gcd_of_the_element_sizes() -> None:
    assert word_size([2, 4, 2]) == 2
    assert word_size([4]) == 4
    assert word_size([1, 2]) == 1
    with pytest.raises(InvalidArgument):
        word_size([])


def test_mixed_dtype_message_in_two_byte_words() -> None:
    base = torch.cat([_image(torch.randn(3701).bfloat16()), _image(torch.randn(1301))])
    current = base.clone()
    current[10:12] ^= 0x5A
    current[8000:8004] ^= 0x01  # one float32 element: two 2-byte words
    header = choose_encoding(base.numel(), int(changed_words(current, base, 2)), 2)
    assert header.encoding is Encoding.INDEX
    assert header.changed == 3
    payload = torch.empty(header.nbytes, dtype=torch.uint8)
    encode_into(current, base, header, 2, payload)
    received = base.clone()
    apply_delta(received, header, 2, payload)
    assert torch.equal(received, current)


def test_a_payload_of_the_wrong_size_is_refused() -> None:
    base = _image(torch.zeros(8))
    header = DeltaHeader(Encoding.INDEX, 1, encoded_nbytes(Encoding.INDEX, base.numel(), 1, 4))
    with pytest.raises(InvalidArgument, match="payload"):
        apply_delta(base.clone(), header, 4, torch.empty(header.nbytes + 1, dtype=torch.uint8))
    with pytest.raises(InvalidArgument, match="changed since they were counted"):
        encode_into(base, base, header, 4, torch.empty(header.nbytes, dtype=torch.uint8))


def test_bitmap_packing_for_every_byte_pattern() -> None:
    """All 256 patterns of eight words (the packing multiplies eight 0/1 bytes as one int64):
    only the flagged words change."""
    patterns = torch.arange(256)
    flags = ((patterns.unsqueeze(1) >> torch.arange(8)) & 1).bool().flatten()
    base = torch.zeros(flags.numel(), dtype=torch.int16)
    current = base.clone()
    current[flags] = 7
    old, new = _image(base), _image(current)
    header = DeltaHeader(
        Encoding.BITMAP,
        int(flags.sum()),
        encoded_nbytes(Encoding.BITMAP, new.numel(), int(flags.sum()), 2),
    )
    payload = torch.empty(header.nbytes, dtype=torch.uint8)
    encode_into(new, old, header, 2, payload)
    assert torch.equal(payload[:256], patterns.to(torch.uint8))
    received = old.clone()
    apply_delta(received, header, 2, payload)
    assert torch.equal(received, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.05, 0.6])
@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("update_base", [False, True])
def test_one_scan_encodes_the_same_payload_and_can_advance_the_base(
    dtype: torch.dtype, fraction: float, encoding: Encoding, update_base: bool
) -> None:
    """The fused path (`scan`, then `encode_scanned`) writes exactly `encode_into`'s bytes,
    and with `update_base` leaves the base holding the current bytes."""
    base = torch.randn(5003, generator=torch.Generator().manual_seed(4)).to(dtype)
    current = _perturbed(base, fraction, seed=5)
    word = base.element_size()
    old, new = _image(base), _image(current)
    changed = int(changed_words(new, old, word))
    header = DeltaHeader(encoding, changed, encoded_nbytes(encoding, new.numel(), changed, word))
    want = torch.full((header.nbytes,), 0xFF, dtype=torch.uint8)
    encode_into(new, old, header, word, want)
    snapshot = old.clone()
    found = scan(new, snapshot, word, update_base=update_base)
    assert int(found.count) == changed
    assert torch.equal(snapshot, new if update_base else old)
    got = torch.full((header.nbytes,), 0xAA, dtype=torch.uint8)
    encode_scanned(new, found, header, word, got)
    assert torch.equal(got, want)
