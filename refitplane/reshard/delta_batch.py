"""A sender's delta kernels over many messages at once (CUDA): one launch per pass for all
the delta messages of a transfer, instead of a few per message.

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
messages (`Gather.launch`) so sends can follow part by part. Receivers apply payloads with
`delta_apply`, group by group while the transfer runs.
"""

# Triton reads the kernels' signatures: they carry no annotations.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.delta import DeltaHeader, Encoding, encoded_nbytes


def _launch_setting(name: str, default: int, lowest: int, highest: int) -> int:
    """A power of two from the environment (read once, at import: the kernels' shapes)."""
    raw = os.environ.get(name, "").strip()
    value = int(raw) if raw.isdigit() else (default if not raw else -1)
    if not lowest <= value <= highest or value & (value - 1):
        raise InvalidArgument(
            f"{name} must be a power of two from {lowest} to {highest}, got {raw!r}", field=name
        )
    return value


# Words per program of the sender's scan and gather (a power of two from 8, so bitmap bytes
# never straddle programs, to 65536), and the scan's warps per program. Settings for measuring
# the scan's speed (`benchmarks/delta_scan_gpu.py`); the defaults are what ran on 2xH100.
BLOCK = _launch_setting("REFIT_DELTA_SCAN_BLOCK", 4096, 8, 65536)
SCAN_WARPS = _launch_setting("REFIT_DELTA_SCAN_WARPS", 4, 1, 32)
# How the scan takes the checksum sums: "reload" (the block again as 64-bit words, from the
# cache; what ran on 2xH100) or "words" (from the words already loaded, `folded_sums`).
SCAN_SUMS = os.environ.get("REFIT_DELTA_SCAN_SUMS", "reload").strip() or "reload"
if SCAN_SUMS not in ("reload", "words"):
    raise InvalidArgument(
        f"REFIT_DELTA_SCAN_SUMS must be 'reload' or 'words', got {SCAN_SUMS!r}",
        field="REFIT_DELTA_SCAN_SUMS",
    )
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
    def locate(pid, block_msg, blk0, ns, BLOCK: tl.constexpr):
        """This program's message, its block within it, the block's first word (int64) and
        its words as rows of 8 (one bitmap byte each), [rows, 8] int32 offsets from the
        first word, with which of them lie inside the message. Rows keep every step within
        a thread or a 512-long scan (a 1-D 4096-long scan or reshape costs several shared
        memory passes); 32-bit offsets from a 64-bit block start keep register use low (a
        program's latency is hidden only by many programs resident at once)."""
        m = tl.load(block_msg + pid)
        local = pid.to(tl.int64) - tl.load(blk0 + m)
        first = local * BLOCK
        left = tl.minimum(tl.load(ns + m) - first, BLOCK).to(tl.int32)
        inner = tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
        return m, local, first, inner, inner < left

    @triton.jit
    def folded_sums(a, inner, first, WORD_BYTES: tl.constexpr, BLOCK: tl.constexpr):
        """(S0, S1) of `checksum.py` for a block's words already loaded ([rows, 8], words
        past the image zero), without loading them again as 64-bit words: word (r, c) is
        bytes [(8r + c) * WORD_BYTES, ...) of the block, so it adds its unsigned value,
        shifted to its place in 64-bit word r * WORD_BYTES + c * WORD_BYTES // 8, to S0, and
        that times the 64-bit word's index in the message to S1 (wrapping int64, as the
        checksum). Per column: S0 += U_c << shift_c, S1 += ((w0 + q_c) U_c + WORD_BYTES
        sum_r r u_rc) << shift_c, with U_c the column's sum."""
        u = a.to(tl.int64)
        if WORD_BYTES < 8:
            u = u & ((1 << (8 * WORD_BYTES)) - 1)
        rows = inner // 8  # [rows, 8]: each word's row
        if WORD_BYTES <= 2:  # noqa: SIM108 (a branch on a constexpr, not a value)
            # r * u < 2^13 * 2^16 for blocks up to 65536 words (`BLOCK`): in 32 bits.
            ru = (rows * u.to(tl.int32)).to(tl.int64)
        else:
            ru = rows.to(tl.int64) * u
        column = tl.arange(0, 8)
        shift = (column * WORD_BYTES % 8) * 8
        w0 = first * WORD_BYTES // 8 + column * WORD_BYTES // 8  # [8]: each column's q offset
        total = tl.sum(u, axis=0)  # [8]
        weighted = tl.sum(ru, axis=0)  # [8]
        s0 = tl.sum(total << shift, axis=0)
        s1 = tl.sum((w0 * total + WORD_BYTES * weighted) << shift, axis=0)
        return s0, s1

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
        sums,
        UPDATE: tl.constexpr,
        WORD: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
        SUMS: tl.constexpr,
        SUMS_FROM_WORDS: tl.constexpr = False,
    ):
        m, local, first, inner, inside = locate(tl.program_id(0), block_msg, blk0, ns, BLOCK)
        cur = tl.load(curs + m).to(tl.pointer_type(WORD))
        base = tl.load(bases + m).to(tl.pointer_type(WORD))
        if ALIGNED:
            # An address read from a table tells the compiler nothing, and it then loads word
            # by word instead of 16 bytes at a time (the scan is a pass over both images):
            # where every image of the launch is 16-byte aligned, say so.
            cur = tl.multiple_of(cur, 16)
            base = tl.multiple_of(base, 16)
        cur += first
        base += first
        full = tl.load(ns + m) - first >= BLOCK
        # A block wholly inside its message (all but a message's last) loads unmasked: a
        # mask per word would keep Triton from loading 16 bytes at a time too.
        if full:
            a = tl.load(cur + inner)
            b = tl.load(base + inner)
        else:
            a = tl.load(cur + inner, mask=inside, other=0)
            b = tl.load(base + inner, mask=inside, other=0)
        changed = ((a != b) & inside).to(tl.int32)
        packed = tl.sum(changed << tl.arange(0, 8)[None, :], axis=1)
        tl.store(counts + tl.program_id(0), tl.sum(tl.sum(changed, axis=1), axis=0))
        here = bits + tl.load(bits_at + m) + local * (BLOCK // 8)
        tl.store(here + tl.arange(0, BLOCK // 8), packed.to(tl.uint8))
        if UPDATE:
            tl.store(base + inner, a, mask=changed != 0)
        if SUMS and SUMS_FROM_WORDS:
            out_at = tl.load(sums + m)
            if out_at != 0:
                s0, s1 = folded_sums(a, inner, first, WORD_BYTES, BLOCK)
                out = out_at.to(tl.pointer_type(tl.int64))
                tl.atomic_add(out, s0)
                tl.atomic_add(out + 1, s1)
        if SUMS and not SUMS_FROM_WORDS:
            # The sender's checksum of the message (`checksum.py`'s S0, S1 over its 64-bit
            # words) from the same pass: the block's bytes again as int64, from the cache.
            out_at = tl.load(sums + m)
            if out_at != 0:
                w0 = first * WORD_BYTES // 8  # the block's first 64-bit word in the message
                k = tl.arange(0, BLOCK * WORD_BYTES // 8)
                words64 = cur.to(tl.pointer_type(tl.int64), bitcast=True) + k
                if full:
                    x = tl.load(words64)
                else:
                    left64 = tl.load(ns + m) * WORD_BYTES // 8 - w0
                    x = tl.load(words64, mask=k < left64, other=0)
                out = out_at.to(tl.pointer_type(tl.int64))
                tl.atomic_add(out, tl.sum(x, axis=0))
                tl.atomic_add(out + 1, tl.sum(x * (w0 + k), axis=0))

    # `first`: the launch's first block (a gather runs in parts, `Gather.launch`); not
    # specialized, so every part runs the one compiled variant.
    @triton.jit(do_not_specialize=["first_block"])
    def gather(
        first_block,
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
        pid = tl.program_id(0) + first_block
        m, local, first, _, _ = locate(pid, block_msg, blk0, ns, BLOCK)
        kind = tl.load(kinds + m)
        if kind != 0:
            # The scan left no flag past the message's end.
            rows = tl.arange(0, BLOCK // 8)
            here = bits + tl.load(bits_at + m) + local * (BLOCK // 8)
            packed = tl.load(here + rows).to(tl.int32)
            if kind == 2:
                out = tl.load(maps + m).to(tl.pointer_type(tl.uint8)) + local * (BLOCK // 8)
                left = tl.load(map_bytes + m) - local * (BLOCK // 8)
                tl.store(out + rows, packed.to(tl.uint8), mask=rows < left)
            # Each changed word's place: the block's start, the words changed in earlier
            # rows of the block, then the set bits below its own in its row. One bit (word
            # column) at a time: [rows] vectors keep few registers per thread, so many
            # programs stay resident to hide each one's chain of table loads.
            per_row = popc(packed)
            before = tl.cumsum(per_row, axis=0) - per_row
            start = tl.load(starts + pid)
            cur = tl.load(curs + m).to(tl.pointer_type(WORD)) + first
            out_values = tl.load(values + m).to(tl.pointer_type(WORD)) + start
            # Index payloads only for messages under 2^31 words (`choose_encoding`).
            index = tl.load(indexes + m).to(tl.pointer_type(tl.int32)) + start
            first32 = first.to(tl.int32)
            for k in tl.static_range(8):
                changed = ((packed >> k) & 1) != 0
                rank = before + popc(packed & ((1 << k) - 1))
                word = rows * 8 + k
                a = tl.load(cur + word, mask=changed, other=0)
                if kind == 1:
                    tl.store(index + rank, first32 + word, mask=changed)
                tl.store(out_values + rank, a, mask=changed)

    # The kernels call the helpers by name: Triton's interpreter (TRITON_INTERPRET=1, how the
    # CPU tests run these kernels) looks names up in the module's globals.
    globals().update(locate=locate, popc=popc, folded_sums=folded_sums)
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
    (`counts`, int64 on the device) and what `prepare_gather` needs."""

    word: int
    blocks: Blocks
    currents: list[torch.Tensor]
    bits: torch.Tensor
    bits_at: torch.Tensor
    block_counts: torch.Tensor
    counts: torch.Tensor
    # Which messages' checksum sums the scan added into their rows (`scan_many`'s `sums`).
    summed: tuple[bool, ...] = ()


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
    scan, _ = _compile()
    device = currents[0].device
    blocks = blocks_of([c.numel() // word for c in currents], device)
    # Each message's bitmap starts at its first block's bytes (whole blocks each).
    bits_at = blocks.blk0 * _BITS
    bits = torch.empty(blocks.count * _BITS, dtype=torch.uint8, device=device)
    block_counts = torch.empty(blocks.count, dtype=torch.int32, device=device)
    aligned = all(t.data_ptr() % 16 == 0 for t in (*currents, *bases))
    rows: list[torch.Tensor | None] = [
        row if row is not None and not c.numel() % 8 and not c.data_ptr() % 8 else None
        for c, row in zip(currents, sums or [None] * len(currents), strict=True)
    ]
    summed = tuple(row is not None for row in rows)
    scan[(blocks.count,)](
        blocks.block_msg,
        blocks.blk0,
        blocks.ns,
        _addresses(currents, device),
        _addresses(bases, device),
        bits_at,
        bits,
        block_counts,
        _addresses(rows, device) if any(summed) else block_counts,
        UPDATE=update,
        WORD=_TL_WORDS[word],
        WORD_BYTES=word,
        BLOCK=BLOCK,
        ALIGNED=aligned,
        SUMS=any(summed),
        SUMS_FROM_WORDS=SCAN_SUMS == "words",
        num_warps=SCAN_WARPS,
    )
    counts = torch.zeros(len(currents), dtype=torch.int64, device=device)
    counts.index_add_(0, blocks.block_msg.long(), block_counts.long())
    return ScanBatch(word, blocks, list(currents), bits, bits_at, block_counts, counts, summed)


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
        dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word]
        for m, first, n in zip(message.tolist(), local.tolist(), size.tolist(), strict=True):
            a = currents[m].view(dtype)[first * BLOCK : first * BLOCK + n]
            b = bases[m].view(dtype)[first * BLOCK : first * BLOCK + n]
            changed[m] += int(torch.count_nonzero(a != b))
        return _scaled(changed, ns, seen.tolist())
    scan, _ = _compile()
    device = currents[0].device
    count = len(message)
    at = torch.from_numpy(local * BLOCK * word)
    index = torch.from_numpy(message)
    cur = torch.tensor([c.data_ptr() for c in currents], dtype=torch.int64)[index] + at
    old = torch.tensor([b.data_ptr() for b in bases], dtype=torch.int64)[index] + at
    firsts = torch.arange(count, dtype=torch.int64)
    # Each sampled block is a message of its own to the scan: one block, at its address.
    tables = torch.stack([cur, old, firsts, torch.from_numpy(size), firsts * _BITS]).to(device)
    found = torch.empty(count, dtype=torch.int32, device=device)
    scan[(count,)](
        firsts.to(device=device, dtype=torch.int32),
        tables[2],
        tables[3],
        tables[0],
        tables[1],
        tables[4],
        torch.empty(count * _BITS, dtype=torch.uint8, device=device),
        found,
        found,
        UPDATE=False,
        WORD=_TL_WORDS[word],
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

    def launch(self, first: int = 0, end: int | None = None) -> None:
        """Write the payloads of messages [first, end) (of the batch's order) on the
        current stream."""
        _, gather = _compile()
        end = len(self.first_blocks) - 1 if end is None else end
        b0, b1 = self.first_blocks[first], self.first_blocks[end]
        if b1 > b0:
            gather[(b1 - b0,)](b0, *self.args, WORD=_TL_WORDS[self.word], BLOCK=BLOCK)


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
    args = (
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
    )
    firsts = [0]
    for n in batch.blocks.per_message:
        firsts.append(firsts[-1] + n)
    return Gather(args, batch.word, tuple(firsts))
