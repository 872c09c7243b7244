"""A sender's delta kernels over many messages at once (CUDA): one launch per pass for all
the delta messages of a transfer, instead of a few per message.

A Triton launch costs tens of microseconds on the host, a torch op about ten; a Qwen3-8B
rank sends ~400 messages, so per-message kernels cost more than the passes themselves (seen
on one H100: 100-200 ms of a delta refit against 52 ms for the full one). Here the messages
of one word size are one launch: a table (built on the host, one int32 per block of
`BLOCK` words) maps each program to its message and its block within it, and per-message
tables hold the addresses (`data_ptr`) of the message's memory.

Sender: `scan_many` reads current and base once (per block: the changed count, a bitmap of
the changed words into one scratch buffer, and, with `update`, the changed words written
into the base); `gather_many` reads only the bitmap and the changed words and writes every
payload (index or bitmap section, values) at its block's prefix sum: the same bytes as
`delta.encode_into`. Receivers apply payloads with `delta_apply`, group by group while
the transfer runs.
"""

# Triton reads the kernels' signatures: they carry no annotations.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.delta import DeltaHeader, Encoding, encoded_nbytes

BLOCK = 4096  # words per program (a multiple of 8: bitmap bytes never straddle programs)
_BITS = BLOCK // 8
_kernels: Any = None
_TL_WORDS: dict[int, Any] = {}


def _compile() -> Any:
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    from refitplane.reshard.triton_rows import popc

    @triton.jit
    def locate(block_msg, blk0, ns, BLOCK: tl.constexpr):
        """This program's message, its block within it, the block's bitmap bytes (rows of 8
        words: `rows`, within the message), its word offsets as [rows, 8] and which of them
        lie inside the message. Working on rows keeps every step within a thread or a
        512-long scan: a 1-D 4096-long scan or reshape costs several shared-memory passes."""
        m = tl.load(block_msg + tl.program_id(0))
        local = tl.program_id(0).to(tl.int64) - tl.load(blk0 + m)
        rows = local * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
        return m, rows, offs, offs < tl.load(ns + m)

    @triton.jit
    def scan(
        block_msg,
        blk0,
        ns,
        curs,
        bases,
        bits_at,
        bits,
        counts,
        UPDATE: tl.constexpr,
        WORD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        m, rows, offs, inside = locate(block_msg, blk0, ns, BLOCK)
        cur = tl.load(curs + m).to(tl.pointer_type(WORD))
        base = tl.load(bases + m).to(tl.pointer_type(WORD))
        a = tl.load(cur + offs, mask=inside, other=0)
        b = tl.load(base + offs, mask=inside, other=0)
        changed = ((a != b) & inside).to(tl.int32)
        packed = tl.sum(changed << tl.arange(0, 8)[None, :], axis=1)
        tl.store(counts + tl.program_id(0), tl.sum(tl.sum(changed, axis=1), axis=0))
        tl.store(bits + tl.load(bits_at + m) + rows, packed.to(tl.uint8))
        if UPDATE:
            tl.store(base + offs, a, mask=changed != 0)

    @triton.jit
    def gather(
        block_msg,
        blk0,
        ns,
        curs,
        bits_at,
        bits,
        starts,
        kinds,
        maps,
        map_bytes,
        indexes,
        values,
        WORD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        m, rows, offs, _ = locate(block_msg, blk0, ns, BLOCK)
        kind = tl.load(kinds + m)
        if kind != 0:
            # The scan left no flag past the message's end.
            packed = tl.load(bits + tl.load(bits_at + m) + rows).to(tl.int32)
            if kind == 2:
                out = tl.load(maps + m).to(tl.pointer_type(tl.uint8))
                tl.store(out + rows, packed.to(tl.uint8), mask=rows < tl.load(map_bytes + m))
            # Each changed word's place: the block's start, the words changed in earlier
            # rows of the block, then the set bits below its own in its row.
            per_row = popc(packed)
            before = tl.cumsum(per_row, axis=0) - per_row
            bit = tl.arange(0, 8)[None, :]
            changed = ((packed[:, None] >> bit) & 1) != 0
            below = popc(packed[:, None] & ((1 << bit) - 1))
            at = tl.load(starts + tl.program_id(0)) + before[:, None] + below
            cur = tl.load(curs + m).to(tl.pointer_type(WORD))
            a = tl.load(cur + offs, mask=changed, other=0)
            if kind == 1:
                index = tl.load(indexes + m).to(tl.pointer_type(tl.int32))
                tl.store(index + at, offs.to(tl.int32), mask=changed)
            tl.store(tl.load(values + m).to(tl.pointer_type(WORD)) + at, a, mask=changed)

    # The kernels call the helpers by name: Triton's interpreter (TRITON_INTERPRET=1, how the
    # CPU tests run these kernels) looks names up in the module's globals.
    globals().update(locate=locate, popc=popc)
    _TL_WORDS.update({1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64})
    _kernels = (scan, gather)
    return _kernels


@dataclass(frozen=True)
class Blocks:
    """Messages of `ns` words each, cut into blocks of `BLOCK`: which message each block
    belongs to (`block_msg`), each message's first block (`blk0`) and word count (`ns`),
    on the device."""

    block_msg: torch.Tensor
    blk0: torch.Tensor
    ns: torch.Tensor
    count: int
    per_message: tuple[int, ...]


_BLOCKS_CACHE: dict[tuple[torch.device, tuple[int, ...]], Blocks] = {}


def blocks_of(ns: Sequence[int], device: torch.device) -> Blocks:
    """The block tables of messages of `ns` words, kept for the next call with the same
    sizes (a sender's messages repeat every refit)."""
    key = (device, tuple(ns))
    found = _BLOCKS_CACHE.get(key)
    if found is not None:
        return found
    per = [max(1, (n + BLOCK - 1) // BLOCK) for n in ns]
    sizes = torch.tensor(per, dtype=torch.int64)
    first = torch.cumsum(sizes, 0) - sizes
    owner = torch.repeat_interleave(torch.arange(len(per), dtype=torch.int32), sizes)
    blocks = Blocks(
        _table(owner, torch.int32, device),
        _table(first, torch.int64, device),
        _table(list(ns), torch.int64, device),
        int(sizes.sum()),
        tuple(per),
    )
    _BLOCKS_CACHE[key] = blocks  # one entry per distinct transfer layout of this process
    return blocks


def _table(
    values: Sequence[int] | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host values as a device tensor."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host.to(device=device, dtype=dtype)


def _addresses(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    return _table([t.data_ptr() if t is not None else 0 for t in tensors], torch.int64, device)


def _local_starts(counts: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Each block's exclusive prefix sum of `counts` within its message."""
    exclusive = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    return exclusive - exclusive[blocks.blk0][blocks.block_msg.long()]


@dataclass
class ScanBatch:
    """What `scan_many` found for messages of one word size: per-message changed counts
    (`counts`, int64 on the device) and what `gather_many` needs."""

    word: int
    blocks: Blocks
    currents: list[torch.Tensor]
    bits: torch.Tensor
    bits_at: torch.Tensor
    block_counts: torch.Tensor
    counts: torch.Tensor


def scan_many(
    currents: Sequence[torch.Tensor], bases: Sequence[torch.Tensor], word: int, *, update: bool
) -> ScanBatch:
    """One pass over every (current, base) image pair (1-D contiguous uint8 on one CUDA
    device, `word`-byte words); with `update` the bases end holding the current bytes."""
    scan, _ = _compile()
    device = currents[0].device
    blocks = blocks_of([c.numel() // word for c in currents], device)
    # Each message's bitmap starts at its first block's bytes (whole blocks each).
    bits_at = blocks.blk0 * _BITS
    bits = torch.empty(blocks.count * _BITS, dtype=torch.uint8, device=device)
    block_counts = torch.empty(blocks.count, dtype=torch.int32, device=device)
    scan[(blocks.count,)](
        blocks.block_msg,
        blocks.blk0,
        blocks.ns,
        _addresses(currents, device),
        _addresses(bases, device),
        bits_at,
        bits,
        block_counts,
        UPDATE=update,
        WORD=_TL_WORDS[word],
        BLOCK=BLOCK,
    )
    counts = torch.zeros(len(currents), dtype=torch.int64, device=device)
    counts.index_add_(0, blocks.block_msg.long(), block_counts.long())
    return ScanBatch(word, blocks, list(currents), bits, bits_at, block_counts, counts)


def _sections(
    header: DeltaHeader, words: int, word: int, payload: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(index, bitmap, values) views of a payload (`delta`'s layout)."""
    values = payload[header.nbytes - header.changed * word :]
    if header.encoding is Encoding.INDEX:
        return payload[: header.changed * 4], None, values
    return None, payload[: (words + 7) // 8], values


def gather_many(
    batch: ScanBatch, headers: Sequence[DeltaHeader], payloads: Sequence[torch.Tensor | None]
) -> None:
    """Write every non-dense message's payload (zero-filled buffers of `header.nbytes`)."""
    _, gather = _compile()
    device = batch.bits.device
    kinds: list[int] = []
    map_bytes: list[int] = []
    maps: list[torch.Tensor | None] = []
    indexes: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    for header, payload, current in zip(headers, payloads, batch.currents, strict=True):
        words = current.numel() // batch.word
        if header.encoding is Encoding.DENSE or payload is None:
            kinds.append(0)
            maps.append(None)
            map_bytes.append(0)
            indexes.append(None)
            values.append(None)
            continue
        if payload.numel() != encoded_nbytes(
            header.encoding, words * batch.word, header.changed, batch.word
        ):
            raise InvalidArgument(
                f"payload of {payload.numel()} bytes for a {header.encoding.name} delta of "
                f"{header.changed} words, header says {header.nbytes}"
            )
        index, bitmap, vals = _sections(header, words, batch.word, payload)
        kinds.append(int(header.encoding))
        maps.append(bitmap)
        map_bytes.append(bitmap.numel() if bitmap is not None else 0)
        indexes.append(index)
        values.append(vals)
    if not any(kinds):
        return
    gather[(batch.blocks.count,)](
        batch.blocks.block_msg,
        batch.blocks.blk0,
        batch.blocks.ns,
        _addresses(batch.currents, device),
        batch.bits_at,
        batch.bits,
        _local_starts(batch.block_counts, batch.blocks),
        _table(kinds, torch.int32, device),
        _addresses(maps, device),
        _table(map_bytes, torch.int64, device),
        _addresses(indexes, device),
        _addresses(values, device),
        WORD=_TL_WORDS[batch.word],
        BLOCK=BLOCK,
    )
