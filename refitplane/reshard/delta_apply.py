"""Receivers' delta applies on CUDA, posted with the transfer: no host wait, no allocation.

A receiver applies each completed group's deltas into the message images (live parameters
for direct messages) on the channel's side stream, right after the group's transfer. Its
host must not wait there: a host that blocks until a group has arrived posts the next group
only then, and the refit runs one group at a time (a pageable host→device copy of a launch
table, what torch does for `tensor.to(device)`, synchronizes the stream it runs on, so the
host waits for the group's transfer). Nor may it allocate device or page-locked memory while
NCCL kernels are in flight (`executor.py`). So a transfer's room is reserved before its first
message (`ApplyRoom`, made when the header tables arrived): a page-locked row table with a
row per delta message and its device twin, and, for bitmap payloads, the per-block prefix
sums in the payload arena. Per group the host writes the group's rows (plain integers)
into the next free slice, copies it asynchronously, and launches the kernels; the kernels
are compiled and loaded by the room, before anything is in flight.

Row (9 int64): first program, kind (1 index, 2 bitmap), image address, image words, index
or bitmap address, values address, changed words, prefix-sum address (bitmap), checksum-row
address or 0. Where a message's row is given, the scatter adds to it what each word it
writes changes in the image's checksum sums (`checksum.py`: S0 and S1 are sums over the
image's 64-bit words, so replacing a word changes them by its difference, shifted to its
place in its 64-bit word): a receiver that summed its base image before the transfer (while
the sender scanned) then holds the sums of what the image holds afterwards without reading it
again. A launch's
programs find their row by a fixed-depth binary search on the first-program column (one
compiled variant whatever the table's length, `triton_rows`). Per word size, up to three
launches per group: bitmap popcounts per block of words, their exclusive prefix sums per
message (one program per message), and the scatter of every message (index payloads over
blocks of values, bitmap payloads over blocks of words). An index or flag that points
outside its message or past its values is dropped, never written; the per-message checksums
then fail the message.
"""

# Triton reads the kernels' signatures: they carry no annotations.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.delta import DeltaHeader, Encoding
from refitplane.reshard.triton_load import launch_setting

BLOCK = 4096  # words (or values) per program; a multiple of 8: bitmap bytes stay in one
ROW = 9
# Values an index payload's program applies per step of its loop (a power of two up to
# BLOCK; BLOCK: the whole block at once, as before 2026-11-27, for comparing on a GPU).
INDEX_CHUNK = launch_setting("REFIT_DELTA_APPLY_CHUNK", 1024, 64, BLOCK)
_PREFIX_CHUNK = 1024  # block counts summed per step of a message's prefix program
_SEARCH_STEPS = 20  # rows per launch below 2^20
_kernels: Any = None
_TL_WORDS: dict[int, Any] = {}
_loaded: set[tuple[torch.device, int]] = set()


def _compile() -> Any:
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    from refitplane.reshard.triton_rows import WORD_TYPES, popc, program_row_of

    @triton.jit
    def row_bits(row, local, BLOCK: tl.constexpr):
        """This block's bitmap bytes (rows of 8 words) with flags past the image's end
        cleared, and its words as [rows, 8] int32 offsets from the block's first word. Rows
        keep every step within a thread or a 512-long scan (a 4096-long one costs several
        shared-memory passes); 32-bit offsets keep register use low."""
        left = tl.minimum(tl.load(row + 3) - local * BLOCK, BLOCK).to(tl.int32)
        rows = tl.arange(0, BLOCK // 8)
        bitmap = tl.load(row + 4).to(tl.pointer_type(tl.uint8)) + local * (BLOCK // 8)
        packed = tl.load(bitmap + rows, mask=rows < (left + 7) // 8, other=0).to(tl.int32)
        inner = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
        # Bits of the last byte past the last word (a bad payload) count for nothing.
        valid = tl.sum((inner < left).to(tl.int32) << tl.arange(0, 8)[None, :], axis=1)
        return packed & valid, inner

    @triton.jit(do_not_specialize=["tab", "n"])
    def popcount(tab, n, STEPS: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        row = program_row_of(tab, n, pid, STEPS, ROW)
        local = pid - tl.load(row)
        packed, _ = row_bits(row, local, BLOCK)
        starts = tl.load(row + 7).to(tl.pointer_type(tl.int64))
        tl.store(starts + local, tl.sum(popc(packed), axis=0).to(tl.int64))

    @triton.jit(do_not_specialize=["tab"])
    def prefix(tab, ROW: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """Row `program_id`'s block counts into their exclusive prefix sums, in place."""
        row = tab + tl.program_id(0).to(tl.int64) * ROW
        words = tl.load(row + 3)
        blocks = (words + BLOCK - 1) // BLOCK
        starts = tl.load(row + 7).to(tl.pointer_type(tl.int64))
        carry = words * 0
        for at in range(0, blocks, CHUNK):
            offs = at + tl.arange(0, CHUNK)
            inside = offs < blocks
            counts = tl.load(starts + offs, mask=inside, other=0)
            tl.store(starts + offs, carry + tl.cumsum(counts, axis=0) - counts, mask=inside)
            carry += tl.sum(counts, axis=0)

    @triton.jit
    def word_change(where, old, new, inside, WORD_BYTES: tl.constexpr):
        """(S0, S1) change of the checksum sums when the words at `where` (word indices in
        the image) go from `old` to `new` where `inside`: each word's difference, unsigned,
        shifted to its bytes' place in its 64-bit word; wrapping int64 arithmetic."""
        at = where.to(tl.int64) * WORD_BYTES
        if WORD_BYTES == 8:
            diff = new.to(tl.int64) - old.to(tl.int64)
        else:
            mask = (1 << (8 * WORD_BYTES)) - 1
            diff = (new.to(tl.int64) & mask) - (old.to(tl.int64) & mask)
        diff = tl.where(inside, diff << ((at % 8) * 8), 0)
        return tl.sum(diff, axis=0), tl.sum(diff * (at // 8), axis=0)

    @triton.jit
    def write_words(dst, where, v, mask, sums_at, d0, d1, WORD_BYTES: tl.constexpr):
        """Store `v` at word indices `where` of `dst` (where `mask`) and return (d0, d1)
        plus what that changes in the image's checksum sums, where its row is kept
        (`sums_at`)."""
        if sums_at != 0:
            old = tl.load(dst + where, mask=mask, other=0)
            c0, c1 = word_change(where, old, v, mask, WORD_BYTES)
            d0 += c0
            d1 += c1
        tl.store(dst + where, v, mask=mask)
        return d0, d1

    @triton.jit
    def add_sums(sums_at, d0, d1):
        out = sums_at.to(tl.pointer_type(tl.int64))
        tl.atomic_add(out, d0)
        tl.atomic_add(out + 1, d1)

    @triton.jit
    def scatter_index(
        row,
        local,
        dst,
        words,
        values,
        nvalues,
        sums_at,
        WORD_BYTES: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Values and indices from this block's first; indices are under 2^31 (index
        payloads only for messages below 2^31 words, `choose_encoding`). `CHUNK` values at
        a time (a loop, not unrolled): the whole block's values at once, with their int64
        checksum changes, took 254 registers per thread on sm_90 (ptxas), two programs per
        SM for a kernel of dependent random loads."""
        here = tl.minimum(nvalues - local * BLOCK, BLOCK).to(tl.int32)
        index = tl.load(row + 4).to(tl.pointer_type(tl.int32)) + local * BLOCK
        values = values + local * BLOCK
        d0 = local * 0
        d1 = local * 0
        for at in range(0, BLOCK, CHUNK):
            j = at + tl.arange(0, CHUNK)
            inside = j < here
            where = tl.load(index + j, mask=inside, other=0)
            inside = inside & (where >= 0) & (where < words)
            v = tl.load(values + j, mask=inside, other=0)
            d0, d1 = write_words(dst, where, v, inside, sums_at, d0, d1, WORD_BYTES)
        if sums_at != 0:
            add_sums(sums_at, d0, d1)

    @triton.jit
    def scatter_bitmap(
        row, local, dst, values, nvalues, sums_at, WORD_BYTES: tl.constexpr, BLOCK: tl.constexpr
    ):
        """The i-th flagged word takes the i-th value: the block's prefix, the flags in
        earlier rows of the block, the set bits below its own in its row; one bit (word
        column) at a time, [rows] vectors, in a loop (unrolled, its eight columns' loads
        and int64 checksum changes were live at once): few registers, many programs
        resident."""
        packed, _ = row_bits(row, local, BLOCK)
        per_row = popc(packed)
        before = tl.cumsum(per_row, axis=0) - per_row
        starts = tl.load(row + 7).to(tl.pointer_type(tl.int64))
        start = tl.load(starts + local)
        rows = tl.arange(0, BLOCK // 8)
        d0 = local * 0
        d1 = local * 0
        for k in range(8):
            rank = before + popc(packed & ((1 << k) - 1))
            changed = (((packed >> k) & 1) != 0) & (rank < nvalues - start)
            v = tl.load(values + start + rank, mask=changed, other=0)
            where = local * BLOCK + rows * 8 + k
            d0, d1 = write_words(dst, where, v, changed, sums_at, d0, d1, WORD_BYTES)
        if sums_at != 0:
            add_sums(sums_at, d0, d1)

    @triton.jit(do_not_specialize=["tab", "n"])
    def scatter(
        tab,
        n,
        WORD: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        STEPS: tl.constexpr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        row = program_row_of(tab, n, pid, STEPS, ROW)
        local = pid - tl.load(row)
        dst = tl.load(row + 2).to(tl.pointer_type(WORD))
        values = tl.load(row + 5).to(tl.pointer_type(WORD))
        nvalues = tl.load(row + 6)
        sums_at = tl.load(row + 8)
        # Each encoding in a function of its own: Triton types a name set in both branches
        # of a runtime `if` once, and the two work on vectors of different lengths.
        if tl.load(row + 1) == 1:
            scatter_index(
                row,
                local,
                dst,
                tl.load(row + 3),
                values,
                nvalues,
                sums_at,
                WORD_BYTES,
                BLOCK,
                CHUNK,
            )
        else:
            scatter_bitmap(row, local, dst, values, nvalues, sums_at, WORD_BYTES, BLOCK)

    # The kernels call the helpers by name: Triton's interpreter (TRITON_INTERPRET=1, how the
    # CPU tests run these kernels) looks names up in the module's globals.
    globals().update(
        popc=popc,
        row_bits=row_bits,
        program_row_of=program_row_of,
        word_change=word_change,
        write_words=write_words,
        add_sums=add_sums,
        scatter_index=scatter_index,
        scatter_bitmap=scatter_bitmap,
    )
    _TL_WORDS.update(WORD_TYPES)
    _kernels = (popcount, prefix, scatter)
    return _kernels


# (image, header, word size, payload, bitmap prefix sums, checksum row to keep current)
ApplyItem = tuple[
    torch.Tensor, DeltaHeader, int, torch.Tensor, torch.Tensor | None, torch.Tensor | None
]


def prefix_blocks(words: int) -> int:
    """Prefix-sum entries (int64) a bitmap payload over `words` words needs."""
    return max(1, (words + BLOCK - 1) // BLOCK)


class ApplyRoom:
    """The row tables of one transfer's delta applies (`rows`: at most that many messages
    applied), reserved before its first message; `words`: the word sizes it will apply,
    whose kernels are compiled and loaded here."""

    def __init__(self, device: torch.device, rows: int, words: Sequence[int]) -> None:
        self.device = device
        capacity = max(1, rows) * ROW
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._rows = self._host.numpy()
        self._table = torch.empty(capacity, dtype=torch.int64, device=device)
        self._used = 0
        self._capacity = capacity
        for word in sorted(set(words)):
            _load(device, word)

    def apply(self, items: Sequence[ApplyItem]) -> None:
        """Launch the applies of (image, header, word, payload, prefix sums, checksum row)
        on the current stream: the images (1-D contiguous uint8) end holding the sender's
        bytes, and a given checksum row (two int64, the image's sums before) changes with
        them. No host wait, no allocation (the prefix sums are the room's, `prefix_blocks`
        int64 for a bitmap payload)."""
        # Per word size: bitmap rows, then index rows (so the popcount launch, over bitmap
        # blocks only, sees the same first programs as the scatter over every row).
        bitmap_rows: dict[int, list[list[int]]] = {}
        index_rows: dict[int, list[list[int]]] = {}
        for image, header, word, payload, starts, sums in items:
            if header.encoding is Encoding.DENSE:
                raise InvalidArgument("a dense message is received in place, not applied")
            if payload.numel() != header.nbytes:
                raise InvalidArgument(
                    f"payload of {payload.numel()} bytes, header says {header.nbytes}"
                )
            if header.changed == 0:
                continue
            words = image.numel() // word
            values = payload[header.nbytes - header.changed * word :]
            row = [0, int(header.encoding), image.data_ptr(), words, payload.data_ptr()]
            row += [values.data_ptr(), header.changed, 0]
            row.append(sums.data_ptr() if sums is not None else 0)
            if header.encoding is Encoding.BITMAP:
                if starts is None or starts.numel() < prefix_blocks(words):
                    raise InvalidArgument("a bitmap apply needs room for its prefix sums")
                row[7] = starts.data_ptr()
                bitmap_rows.setdefault(word, []).append(row)
            else:
                index_rows.setdefault(word, []).append(row)
        by_word = {
            w: bitmap_rows.get(w, []) + index_rows.get(w, [])
            for w in sorted({*bitmap_rows, *index_rows})
        }
        if not by_word:
            return
        popcount, prefix, _ = _compile()
        count = sum(len(rows) for rows in by_word.values()) * ROW
        start = self._used
        if start + count > self._capacity:
            raise InvalidArgument(f"delta apply room full ({self._capacity // ROW} rows)")
        self._used += count
        # (word, table offset, rows, bitmap rows, bitmap programs, programs)
        launches: list[tuple[int, int, int, int, int, int]] = []
        at = start
        for word, rows in by_word.items():
            nbitmap = len(bitmap_rows.get(word, ()))
            programs = bitmap_programs = 0
            for i, row in enumerate(rows):
                if i == nbitmap:
                    bitmap_programs = programs
                row[0] = programs
                programs += (row[6 if row[1] == Encoding.INDEX else 3] + BLOCK - 1) // BLOCK
            if nbitmap == len(rows):
                bitmap_programs = programs
            flat = [v for row in rows for v in row]
            self._rows[at : at + len(flat)] = flat
            launches.append((word, at, len(rows), nbitmap, bitmap_programs, programs))
            at += len(flat)
        # Page-locked to device, asynchronous: ordered on this stream, no host wait.
        self._table[start:at].copy_(self._host[start:at], non_blocking=True)
        for word, table_at, n, nbitmap, bitmap_programs, programs in launches:
            tab = self._table[table_at:]
            if nbitmap:
                popcount[(bitmap_programs,)](
                    tab, nbitmap, STEPS=_SEARCH_STEPS, ROW=ROW, BLOCK=BLOCK
                )
                prefix[(nbitmap,)](tab, ROW=ROW, BLOCK=BLOCK, CHUNK=_PREFIX_CHUNK)
            _scatter(tab, n, programs, word)


def _scatter(table: torch.Tensor, rows: int, programs: int, word: int) -> None:
    """One scatter launch over `rows` rows of `table` (`word`-byte words)."""
    scatter = _compile()[2]
    scatter[(programs,)](
        table,
        rows,
        WORD=_TL_WORDS[word],
        WORD_BYTES=word,
        STEPS=_SEARCH_STEPS,
        ROW=ROW,
        BLOCK=BLOCK,
        CHUNK=INDEX_CHUNK,
    )


def _load(device: torch.device, word: int) -> None:
    """Compile and load the kernels for `word` on `device` (once per process): a module
    loaded while NCCL kernels run can block until they end, which a peer may never let
    happen. A probe applies one changed word of each kind to a scratch buffer."""
    if (device, word) in _loaded:
        return
    popcount, prefix, _ = _compile()
    image = torch.zeros(2 * 8, dtype=torch.uint8, device=device)
    payload = torch.zeros(64, dtype=torch.uint8, device=device)
    starts = torch.zeros(1, dtype=torch.int64, device=device)
    words = 8 // word
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    rows = [
        [0, 2, image.data_ptr(), words, payload.data_ptr(), payload[8:].data_ptr(), 1],
        [1, 1, image[8:].data_ptr(), words, payload[16:].data_ptr(), payload[24:].data_ptr()],
    ]
    rows[0] += [starts.data_ptr(), sums.data_ptr()]
    rows[1] += [1, 0, 0]
    table = torch.tensor([v for row in rows for v in row], dtype=torch.int64).to(device)
    popcount[(1,)](table, 1, STEPS=_SEARCH_STEPS, ROW=ROW, BLOCK=BLOCK)
    prefix[(1,)](table, ROW=ROW, BLOCK=BLOCK, CHUNK=_PREFIX_CHUNK)
    _scatter(table, 2, 2, word)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    _loaded.add((device, word))


def apply_many(
    images: Sequence[torch.Tensor],
    headers: Sequence[DeltaHeader],
    word: int,
    payloads: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Apply each payload in place to its image (1-D contiguous uint8, one device, `word`-byte
    words) through a room of its own (outside transfers; tests); `sums`: checksum rows that
    follow the images' changes (`ApplyRoom.apply`)."""
    if not images:
        return
    device = images[0].device
    starts = [
        torch.zeros(prefix_blocks(image.numel() // word), dtype=torch.int64, device=device)
        if h.encoding is Encoding.BITMAP
        else None
        for image, h in zip(images, headers, strict=True)
    ]
    room = ApplyRoom(device, len(images), [word])
    rows = sums if sums is not None else [None] * len(images)
    room.apply(
        [
            (image, h, word, p, s, row)
            for image, h, p, s, row in zip(images, headers, payloads, starts, rows, strict=True)
            if h.encoding is not Encoding.DENSE
        ]
    )
