"""Delta encoding of one message: only the words that changed since the base version.

A message is a run of bytes (its chunks at their offsets, the gaps between them included);
both ends see it as words of `word_size` bytes, the greatest common divisor of its chunks'
element sizes, so a word never straddles two elements' boundaries and a changed bf16 value
costs one 2-byte word. Three encodings, chosen per message by size
(`choose_encoding`), so a delta is never larger than the dense message:

- DENSE: the message's bytes, as a full refit sends them;
- INDEX: the changed words' indices (int32) then their values; best below ~3 % changed;
- BITMAP: one bit per word then the changed words' values; best from ~3 % to ~90 %.

Comparisons are bitwise (words as integers), so -0.0 vs 0.0 and NaN payloads count as
changes and the receiver ends with exactly the sender's bytes. What the receiver holds
after applying is verified like any refit's bytes (the per-message checksums of the
current version), not the delta itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard import delta_triton

WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_BYTES = 4
# Sections of a payload start at multiples of this, so each can be viewed as its words.
_SECTION_ALIGN = 8
_BIT_WEIGHTS_CACHE: dict[torch.device, torch.Tensor] = {}
_PACK_MAGIC = 0x0102040810204080


class Encoding(IntEnum):
    DENSE = 0
    INDEX = 1
    BITMAP = 2


@dataclass(frozen=True, slots=True)
class DeltaHeader:
    """What a receiver needs before the payload arrives: how it is encoded, how many
    words changed, and its size in bytes."""

    encoding: Encoding
    changed: int
    nbytes: int


def word_size(itemsizes: Iterable[int]) -> int:
    """The word a message is compared in: the gcd of its chunks' element sizes."""
    size = 0
    for itemsize in itemsizes:
        size = math.gcd(size, itemsize)
    if size not in WORD_DTYPES:
        raise InvalidArgument(f"no word size for element sizes {sorted(set(itemsizes))}")
    return size


def _align(n: int) -> int:
    return (n + _SECTION_ALIGN - 1) // _SECTION_ALIGN * _SECTION_ALIGN


def _words(image: torch.Tensor, word: int) -> torch.Tensor:
    if image.dtype != torch.uint8 or image.dim() != 1 or not image.is_contiguous():
        raise InvalidArgument("a message image is 1-D contiguous uint8")
    if image.numel() % word:
        raise InvalidArgument(f"a message of {image.numel()} bytes is not in {word}-byte words")
    return image.view(WORD_DTYPES[word])


def changed_words(current: torch.Tensor, base: torch.Tensor, word: int) -> torch.Tensor:
    """How many words differ, as a 0-d int64 tensor on the images' device (no host sync,
    so many messages can be counted before one read-back)."""
    cur, old = _words(current, word), _words(base, word)
    if delta_triton.available(cur):
        return delta_triton.block_counts(cur, old).sum(dtype=torch.int64)
    return torch.count_nonzero(cur != old)


@dataclass(slots=True)
class Scan:
    """What one pass over a message found (`scan`): how many words changed (`count`, 0-d on
    the device, read back with many others at once) and which (`flags`: a bitmap on CUDA, a
    boolean mask on the torch path), for `encode_scanned`."""

    count: torch.Tensor
    flags: torch.Tensor
    block_counts: torch.Tensor | None = field(default=None)


def scan(current: torch.Tensor, base: torch.Tensor, word: int, *, update_base: bool) -> Scan:
    """Compare `current` with `base` once, word by word; with `update_base`, `base` holds
    `current`'s bytes afterwards (a sender's snapshot advanced to the version it sends, in
    the same pass on CUDA)."""
    cur, old = _words(current, word), _words(base, word)
    if delta_triton.available(cur):
        bits = torch.empty((cur.numel() + 7) // 8, dtype=torch.uint8, device=cur.device)
        counts = delta_triton.scan(cur, old, bits, update=update_base)
        return Scan(counts.sum(dtype=torch.int64), bits, counts)
    mask = cur != old
    if update_base:
        old.copy_(cur)
    return Scan(torch.count_nonzero(mask), mask)


def encoded_nbytes(encoding: Encoding, nbytes: int, changed: int, word: int) -> int:
    words = nbytes // word
    if encoding is Encoding.DENSE:
        return nbytes
    if encoding is Encoding.INDEX:
        return _align(changed * _INDEX_BYTES) + changed * word
    return _align((words + 7) // 8) + changed * word


def choose_encoding(nbytes: int, changed: int, word: int) -> DeltaHeader:
    """The smallest encoding of a message of `nbytes` with `changed` words changed (dense
    on ties: it costs no work on either end)."""
    if nbytes // word >= 2**31:
        return DeltaHeader(Encoding.DENSE, changed, nbytes)  # int32 indices would overflow
    best = DeltaHeader(Encoding.DENSE, changed, nbytes)
    for encoding in (Encoding.INDEX, Encoding.BITMAP):
        size = encoded_nbytes(encoding, nbytes, changed, word)
        if size < best.nbytes:
            best = DeltaHeader(encoding, changed, size)
    return best


def _bit_weights(device: torch.device) -> torch.Tensor:
    weights = _BIT_WEIGHTS_CACHE.get(device)
    if weights is None:
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS_CACHE[device] = weights
    return weights


def _pack_bits(mask: torch.Tensor, bitmap: torch.Tensor) -> None:
    """Word i's flag into bit i % 8 of byte i // 8. Eight 0/1 bytes read as one int64
    (little-endian) times _PACK_MAGIC put byte k's bit at bit 56 + k with no carries into
    the top byte (checked for all 256 patterns by the unit tests); one multiply and shift
    instead of eight strided passes."""
    bits = torch.zeros(bitmap.numel() * 8, dtype=torch.uint8, device=mask.device)
    bits[: mask.numel()] = mask
    packed = (bits.view(torch.int64) * _PACK_MAGIC) >> 56
    bitmap.copy_(packed.bitwise_and_(0xFF))


def encode_scanned(
    current: torch.Tensor, found: Scan, header: DeltaHeader, word: int, out: torch.Tensor
) -> None:
    """Write the payload of `current` in `header`'s encoding into `out` (1-D uint8 of
    `header.nbytes`) from a `scan` of the message (the base may have been advanced since):
    on CUDA reading only the flagged words of `current`."""
    if out.numel() != header.nbytes or out.dtype != torch.uint8:
        raise InvalidArgument(f"payload buffer of {out.numel()} bytes, need {header.nbytes}")
    if header.encoding is Encoding.DENSE:
        out.copy_(current)
        return
    cur = _words(current, word)
    values_at = header.nbytes - header.changed * word
    values = out[values_at:].view(WORD_DTYPES[word])
    section_end = (
        header.changed * _INDEX_BYTES
        if header.encoding is Encoding.INDEX
        else (cur.numel() + 7) // 8
    )
    # The gap before the values is alignment padding: zeroed, so a payload's bytes depend
    # on the data alone (the same on every device).
    out[section_end:values_at].zero_()
    index = (
        out[: header.changed * _INDEX_BYTES].view(torch.int32)
        if header.encoding is Encoding.INDEX
        else None
    )
    if found.block_counts is not None:
        # A count that no longer matches is caught by the per-message checksums of the end
        # state, as any other wrong byte would be.
        if index is None:
            out[:section_end].copy_(found.flags)
        delta_triton.gather(cur, found.flags, found.block_counts, values, index)
        return
    mask = found.flags
    if index is not None:
        positions = torch.nonzero(mask).flatten()
        if positions.numel() != header.changed:
            raise InvalidArgument(
                f"{positions.numel()} words changed since they were counted ({header.changed})"
            )
        index.copy_(positions)
        torch.index_select(cur, 0, positions, out=values)
        return
    _pack_bits(mask, out[:section_end])
    selected = cur[mask]  # masked_select is several times slower on CPU
    if selected.numel() != header.changed:
        raise InvalidArgument(
            f"{selected.numel()} words changed since they were counted ({header.changed})"
        )
    values.copy_(selected)


def encode_into(
    current: torch.Tensor, base: torch.Tensor, header: DeltaHeader, word: int, out: torch.Tensor
) -> None:
    """Write the payload of `current` against `base` in `header`'s encoding into `out`
    (1-D uint8 of `header.nbytes`): one `scan`, then `encode_scanned`."""
    if header.encoding is Encoding.DENSE:  # nothing to compare: the bytes themselves
        found = Scan(torch.zeros((), dtype=torch.int64), torch.empty(0, dtype=torch.bool))
    else:
        found = scan(current, base, word, update_base=False)
    encode_scanned(current, found, header, word, out)


def apply_delta(image: torch.Tensor, header: DeltaHeader, word: int, payload: torch.Tensor) -> None:
    """Apply a payload in place to `image`, the receiver's copy of the base version's
    message (1-D contiguous uint8)."""
    if payload.numel() != header.nbytes:
        raise InvalidArgument(f"payload of {payload.numel()} bytes, header says {header.nbytes}")
    if header.encoding is Encoding.DENSE:
        image.copy_(payload)
        return
    dst = _words(image, word)
    values = payload[header.nbytes - header.changed * word :].view(WORD_DTYPES[word])
    nbits = dst.numel()
    if header.encoding is Encoding.INDEX:
        index = payload[: header.changed * _INDEX_BYTES].view(torch.int32)
        if delta_triton.available(dst):
            delta_triton.scatter_index(dst, index, values)
            return
        dst.index_copy_(0, index.long(), values)
        return
    bitmap = payload[: (nbits + 7) // 8]
    if delta_triton.available(dst):
        delta_triton.scatter_bitmap(dst, bitmap, values)
        return
    mask = (bitmap.unsqueeze(1) & _bit_weights(image.device)).ne(0).flatten()[:nbits]
    dst.masked_scatter_(mask, values)
