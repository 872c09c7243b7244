"""A sender's delta passes over many messages at once (CUDA): one launch per pass for all
the delta messages of a transfer, instead of a few per message (the kernels themselves:
`delta_kernels`).

A Triton launch costs tens of microseconds on the host, a torch op about ten; a Qwen3-8B
rank sends ~400 messages, so per-message kernels cost more than the passes themselves (seen
on one H100: 100-200 ms of a delta refit against 52 ms for the full one). Here the messages
of one word size are one launch: a table (built on the host, one int32 per block of
`BLOCK` words) maps each program to its message and its block within it, and per-message
tables hold the addresses (`data_ptr`) of the message's memory.

Sender: `scan_many` reads current and base once (per block: the changed count, a bitmap of
the changed words into one scratch buffer, with `update` the changed words written into the
base, and with `sums` the current bytes' checksum sums); `prepare_gather` reads only the
bitmap and the changed words and writes every payload (index or bitmap section, values) at
its block's prefix sum, the same bytes as `delta.encode_into`, in launches over runs of
messages (`Gather.launch`) so sends can follow part by part. With slots per block
(`delta_kernels.PACK_CAP`) the scan also compacts each block's changed words, and a part's
index payloads come from the slots (`pack`), the gather writing only the blocks that
overflowed them and the bitmap payloads. Receivers apply payloads with
`delta_apply`, group by group while the transfer runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.delta import WORD_DTYPES, DeltaHeader, Encoding, encoded_nbytes
from refitplane.reshard.delta_kernels import (
    BITS,
    BLOCK,
    PACK_CAP,
    PACK_GROUP,
    PACK_WARPS,
    SCAN_SUMS,
    SCAN_UPDATE,
    SCAN_WARPS,
    SUM_STRIPES,
    TL_WORDS,
    compile_kernels,
)


@dataclass(frozen=True)
class Blocks:
    """Messages of `ns` words each, cut into blocks of `BLOCK`: which message each block
    belongs to (`block_msg`), each message's first block (`blk0`), the block after its last
    (`ends`) and word count (`ns`), on the device."""

    block_msg: torch.Tensor
    blk0: torch.Tensor
    ns: torch.Tensor
    count: int
    per_message: tuple[int, ...]
    ends: torch.Tensor


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
        _table(first + sizes, torch.int64, device),
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


def _prefix(counts: torch.Tensor) -> torch.Tensor:
    """The exclusive prefix sums of the block counts (int64), then their total: what both
    the per-message counts and the gather's starts are read from."""
    total = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, dtype=torch.int64, out=total[1:])
    return total


def _per_message(prefix: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Each message's sum of its blocks' counts: a message's blocks are contiguous, so two
    reads of `prefix`. (An `index_add_` by block owner queued one atomic add per block, two
    million for Qwen3-8B, on the few hundred message slots, each slot's in a row.)"""
    return prefix[blocks.ends] - prefix[blocks.blk0]


def _local_starts(prefix: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Each block's exclusive prefix sum of the counts within its message."""
    exclusive = prefix[:-1]
    return exclusive - exclusive[blocks.blk0][blocks.block_msg.long()]


@dataclass
class ScanBatch:
    """What `scan_many` found for messages of one word size: per-message changed counts
    (`counts`, int64 on the device) and what `prepare_gather` needs."""

    word: int
    blocks: Blocks
    currents: list[torch.Tensor]
    bits: torch.Tensor
    bits_at: torch.Tensor
    block_counts: torch.Tensor
    counts: torch.Tensor
    # `block_counts`' exclusive prefix sums, then their total (`_prefix`).
    prefix: torch.Tensor
    # Which messages' checksum sums the scan added into their rows (`scan_many`'s `sums`).
    summed: tuple[bool, ...] = ()
    # With `PACK_CAP`: each block's changed words and their indices, compacted by the scan
    # (`PACK_CAP` slots per block), and how many blocks had more (0-d int64).
    slot_values: torch.Tensor | None = None
    slot_index: torch.Tensor | None = None
    overflow: torch.Tensor | None = None


def scan_many(
    currents: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor],
    word: int,
    *,
    update: bool,
    sums: Sequence[torch.Tensor | None] | None = None,
) -> ScanBatch:
    """One pass over every (current, base) image pair (1-D contiguous uint8 on one CUDA
    device, `word`-byte words); with `update` the bases end holding the current bytes. With
    `sums` (per message a row of two int64, or None), the pass also adds each current image's
    checksum sums (S0, S1, as `checksum.accumulate_sums`) into its row, where the image is
    whole 8-byte words at an 8-byte aligned address (`ScanBatch.summed` says which), so the
    sender reads its bytes once for the scan and its checksum together."""
    scan = compile_kernels()[0]
    device = currents[0].device
    blocks = blocks_of([c.numel() // word for c in currents], device)
    # Each message's bitmap starts at its first block's bytes (whole blocks each).
    bits_at = blocks.blk0 * BITS
    bits = torch.empty(blocks.count * BITS, dtype=torch.uint8, device=device)
    block_counts = torch.empty(blocks.count, dtype=torch.int32, device=device)
    aligned = all(t.data_ptr() % 16 == 0 for t in (*currents, *bases))
    rows: list[torch.Tensor | None] = [
        row if row is not None and not c.numel() % 8 and not c.data_ptr() % 8 else None
        for c, row in zip(currents, sums or [None] * len(currents), strict=True)
    ]
    summed = tuple(row is not None for row in rows)
    # With SUM_STRIPES, each message's sums go to its own stripes of a scratch first.
    stripes: torch.Tensor | None = None
    targets = rows
    if SUM_STRIPES > 1 and any(summed):
        stripes = torch.zeros((len(rows), SUM_STRIPES, 2), dtype=torch.int64, device=device)
        targets = [stripes[i] if row is not None else None for i, row in enumerate(rows)]
    slot_values = slot_index = None
    if PACK_CAP:
        slot_values = torch.empty(blocks.count * PACK_CAP, dtype=WORD_DTYPES[word], device=device)
        slot_index = torch.empty(blocks.count * PACK_CAP, dtype=torch.int32, device=device)
    scan[(blocks.count,)](
        blocks.block_msg,
        blocks.blk0,
        blocks.ns,
        _addresses(currents, device),
        _addresses(bases, device),
        bits_at,
        bits,
        block_counts,
        _addresses(targets, device) if any(summed) else block_counts,
        UPDATE=update,
        WORD=TL_WORDS[word],
        WORD_BYTES=word,
        BLOCK=BLOCK,
        ALIGNED=aligned,
        SUMS=any(summed),
        SUMS_FROM_WORDS=SCAN_SUMS == "words",
        UPDATE_ROWS=SCAN_UPDATE == "rows",
        slot_values=slot_values,
        slot_index=slot_index,
        COMPACT=bool(PACK_CAP),
        CAP=max(1, PACK_CAP),
        STRIPES=SUM_STRIPES,
        num_warps=SCAN_WARPS,
    )
    if stripes is not None:
        folded = stripes.sum(dim=1)  # int64 sums wrap, as the atomics do
        kept = [row for row in rows if row is not None]
        torch._foreach_add_(kept, [folded[i] for i, row in enumerate(rows) if row is not None])
    prefix = _prefix(block_counts)
    overflow = (block_counts > PACK_CAP).sum() if PACK_CAP else None
    return ScanBatch(
        word,
        blocks,
        list(currents),
        bits,
        bits_at,
        block_counts,
        _per_message(prefix, blocks),
        prefix,
        summed,
        slot_values,
        slot_index,
        overflow,
    )


# Blocks a sampled estimate reads across all messages (`sample_changed`): ~8 M words.
SAMPLE_BLOCKS = 2048


def sample_blocks(ns: Sequence[int], budget: int = SAMPLE_BLOCKS) -> tuple[Any, Any, Any]:
    """Which blocks of `BLOCK` words a sampled estimate reads: per message about its share
    of `budget` (at least one, at most all), spread evenly through it. Returns numpy arrays
    (each sample's message, its block within it, its word count)."""
    import numpy as np

    words = np.asarray(ns, dtype=np.int64)
    blocks = np.maximum(1, (words + BLOCK - 1) // BLOCK)
    share = np.maximum(1, budget * blocks // max(1, int(blocks.sum())))
    take = np.minimum(blocks, share)
    message = np.repeat(np.arange(len(words)), take)
    j = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    local = (2 * j + 1) * blocks[message] // (2 * take[message])
    size = np.maximum(0, np.minimum(BLOCK, words[message] - local * BLOCK))
    return message, local, size


def sample_changed(
    currents: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor],
    word: int,
    *,
    kernel: bool = True,
    budget: int = SAMPLE_BLOCKS,
) -> list[int]:
    """Each (current, base) message's changed words estimated from a sample of its blocks
    (`sample_blocks`): how an "auto" sender decides, before scanning, which messages cannot
    beat dense (`delta_cost`). With `kernel`, one launch of the scan (nothing written but
    scratch) and one host read; else torch, block by block."""
    import numpy as np

    ns = [c.numel() // word for c in currents]
    message, local, size = sample_blocks(ns, budget)
    seen = np.bincount(message, weights=size, minlength=len(ns))
    if not kernel:
        changed = [0] * len(ns)
        dtype = WORD_DTYPES[word]
        for m, first, n in zip(message.tolist(), local.tolist(), size.tolist(), strict=True):
            a = currents[m].view(dtype)[first * BLOCK : first * BLOCK + n]
            b = bases[m].view(dtype)[first * BLOCK : first * BLOCK + n]
            changed[m] += int(torch.count_nonzero(a != b))
        return _scaled(changed, ns, seen.tolist())
    scan = compile_kernels()[0]
    device = currents[0].device
    count = len(message)
    at = torch.from_numpy(local * BLOCK * word)
    index = torch.from_numpy(message)
    cur = torch.tensor([c.data_ptr() for c in currents], dtype=torch.int64)[index] + at
    old = torch.tensor([b.data_ptr() for b in bases], dtype=torch.int64)[index] + at
    firsts = torch.arange(count, dtype=torch.int64)
    # Each sampled block is a message of its own to the scan: one block, at its address.
    tables = torch.stack([cur, old, firsts, torch.from_numpy(size), firsts * BITS]).to(device)
    found = torch.empty(count, dtype=torch.int32, device=device)
    scan[(count,)](
        firsts.to(device=device, dtype=torch.int32),
        tables[2],
        tables[3],
        tables[0],
        tables[1],
        tables[4],
        torch.empty(count * BITS, dtype=torch.uint8, device=device),
        found,
        found,
        UPDATE=False,
        WORD=TL_WORDS[word],
        WORD_BYTES=word,
        BLOCK=BLOCK,
        ALIGNED=all(t.data_ptr() % 16 == 0 for t in (*currents, *bases)),
        SUMS=False,
        num_warps=SCAN_WARPS,
    )
    per_message = torch.zeros(len(ns), dtype=torch.int64, device=device)
    per_message.index_add_(0, index.to(device), found.long())
    return _scaled(per_message.tolist(), ns, seen.tolist())


def _scaled(found: Sequence[int], words: Sequence[int], seen: Sequence[float]) -> list[int]:
    """Changed words found in `seen` sampled words, scaled to each message's `words`."""
    return [
        round(int(n) * total / max(1.0, s)) for n, total, s in zip(found, words, seen, strict=True)
    ]


def _sections(
    header: DeltaHeader, words: int, word: int, payload: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(index, bitmap, values) views of a payload (`delta`'s layout)."""
    values = payload[header.nbytes - header.changed * word :]
    if header.encoding is Encoding.INDEX:
        return payload[: header.changed * 4], None, values
    return None, payload[: (words + 7) // 8], values


@dataclass(frozen=True)
class Gather:
    """A batch's gather with its tables on the device, launched in parts (`launch`): a
    sender can then start sending the first messages' payloads while the later ones are
    still being written."""

    args: tuple[Any, ...]
    word: int
    # Each message's first block, and the total: message i's blocks are
    # [first_blocks[i], first_blocks[i + 1]).
    first_blocks: tuple[int, ...]
    # With the scan's slots (`PACK_CAP`): `pack`'s tables, and whether any block is left to
    # the gather (one with more changed words than slots, or a bitmap payload's).
    pack_args: tuple[Any, ...] | None = None
    gather_left: bool = True

    def launch(self, first: int = 0, end: int | None = None) -> None:
        """Write the payloads of messages [first, end) (of the batch's order) on the
        current stream."""
        _, gather, pack = compile_kernels()
        end = len(self.first_blocks) - 1 if end is None else end
        b0, b1 = self.first_blocks[first], self.first_blocks[end]
        if b1 <= b0:
            return
        if self.pack_args is not None:
            programs = (b1 - b0 + PACK_GROUP - 1) // PACK_GROUP
            pack[(programs,)](
                b0,
                b1,
                *self.pack_args,
                WORD=TL_WORDS[self.word],
                CAP=PACK_CAP,
                GROUP=PACK_GROUP,
                num_warps=PACK_WARPS,
            )
        if self.gather_left:
            gather[(b1 - b0,)](
                b0,
                *self.args,
                WORD=TL_WORDS[self.word],
                BLOCK=BLOCK,
                PACKED=self.pack_args is not None,
                CAP=max(1, PACK_CAP),
            )


def prepare_gather(
    batch: ScanBatch, headers: Sequence[DeltaHeader], payloads: Sequence[torch.Tensor | None]
) -> Gather | None:
    """The gather of every non-dense message's payload (zero-filled buffers of
    `header.nbytes`), its tables on the device, ready to launch; None if every message
    goes dense."""
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
        return None
    starts = _local_starts(batch.prefix, batch.blocks)
    kind_table = _table(kinds, torch.int32, device)
    index_table, values_table = _addresses(indexes, device), _addresses(values, device)
    args = (
        batch.blocks.block_msg,
        batch.blocks.blk0,
        batch.blocks.ns,
        _addresses(batch.currents, device),
        batch.bits_at,
        batch.bits,
        starts,
        batch.block_counts,
        kind_table,
        _addresses(maps, device),
        _table(map_bytes, torch.int64, device),
        index_table,
        values_table,
    )
    firsts = [0]
    for n in batch.blocks.per_message:
        firsts.append(firsts[-1] + n)
    if batch.slot_values is None or batch.slot_index is None or batch.overflow is None:
        return Gather(args, batch.word, tuple(firsts))
    pack_args = (
        batch.blocks.block_msg,
        starts,
        batch.block_counts,
        kind_table,
        index_table,
        values_table,
        batch.slot_values,
        batch.slot_index,
    )
    # The counts were read already (the headers): this read waits for nothing more.
    left = int(batch.overflow) > 0 or int(Encoding.BITMAP) in kinds
    return Gather(args, batch.word, tuple(firsts), pack_args, left)
