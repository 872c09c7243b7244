"""The sender's delta kernels (Triton) and their launch shape: `scan` (per block of `BLOCK`
words: the changed count, a bitmap of the changed words, optionally the base updated, the
current bytes' checksum sums and the changed words compacted into slots), `gather` (payloads
written at each block's prefix sum, from the bitmap) and `pack` (from the slots).
`delta_batch` launches them over many messages at once; `compile_kernels` builds them once per
process (Triton is imported only then: CPU-only processes never need it).
"""

# Triton reads the kernels' signatures: they carry no annotations.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import os
from typing import Any

from refitplane.errors import InvalidArgument
from refitplane.reshard.triton_load import launch_setting

# Words per program of the sender's scan and gather (a power of two from 8, so bitmap bytes
# never straddle programs, to 65536), and the scan's warps per program. Settings for measuring
# the scan's speed (`benchmarks/delta_scan_gpu.py`); the defaults are what ran on 2xH100
# (SCAN_UPDATE's default excepted: see there).
BLOCK = launch_setting("REFIT_DELTA_SCAN_BLOCK", 4096, 8, 65536)
SCAN_WARPS = launch_setting("REFIT_DELTA_SCAN_WARPS", 4, 1, 32)
# How the scan takes the checksum sums: "reload" (the block again as 64-bit words, from the
# cache; what ran on 2xH100) or "words" (from the words already loaded, `folded_sums`).
SCAN_SUMS = os.environ.get("REFIT_DELTA_SCAN_SUMS", "reload").strip() or "reload"
if SCAN_SUMS not in ("reload", "words"):
    raise InvalidArgument(
        f"REFIT_DELTA_SCAN_SUMS must be 'reload' or 'words', got {SCAN_SUMS!r}",
        field="REFIT_DELTA_SCAN_SUMS",
    )
# How the scan writes the changed words into the base: "rows" (the default), each row of 8
# words (one bitmap byte) with any change stored whole under one mask per row: its unchanged
# words get the bytes they already hold, and a mask constant along the row lets Triton store
# 16 bytes at a time (sm_90 PTX of a full 4096-word block, 4 warps: 4 `st.global.v4.b32` per
# thread) instead of one predicated 2-byte store per word ("words", what ran on 2xH100 up to
# the eighth session: 32 `st.global.b16` per thread). The bytes in DRAM are about the same
# (a changed word dirties its 32-byte sector either way); at 1 % of bf16 words changed ~8 %
# of rows are written. A message's last, partial block keeps the per-word mask.
SCAN_UPDATE = os.environ.get("REFIT_DELTA_SCAN_UPDATE", "rows").strip() or "rows"
if SCAN_UPDATE not in ("words", "rows"):
    raise InvalidArgument(
        f"REFIT_DELTA_SCAN_UPDATE must be 'words' or 'rows', got {SCAN_UPDATE!r}",
        field="REFIT_DELTA_SCAN_UPDATE",
    )
# Slots per block for the scan's compaction of changed words (0: off, the default until it is
# measured on a GPU). With it the scan writes each block's changed words and their indices,
# in order, into slots of `PACK_CAP` per block (`scan`'s COMPACT: the words are in registers
# there, the bitmap's bits too), and `pack` moves each block's filled slots to its payload
# place (reads only what changed, `GROUP` blocks per program), instead of `gather` finding
# them again from the bitmap and the current image (10 ms on one H100 for a 1 % delta of
# Qwen3-8B: two million programs, each a chain of table loads and a 512-long prefix sum).
# Blocks with more changed words than slots, and bitmap payloads, keep the gather. The slots
# cost `PACK_CAP` x (word + 4) bytes per block: 786 MB for 16.4 GB of bf16 at 64.
PACK_CAP = launch_setting("REFIT_DELTA_PACK_CAP", 0, 0, BLOCK)
# Blocks per program of `pack`, and its warps: 16 blocks of 64 slots over 4 warps took 98
# registers per thread on sm_90 (four programs per SM), over 8 warps 48 (five of twice the
# threads).
PACK_GROUP = 16
PACK_WARPS = 8
# Rows of (S0, S1) the scan's checksum sums of one message are spread over (1: the caller's
# row itself, the default until timed on a GPU). Programs run about in order, so the few
# hundred resident at a time mostly belong to one message and their two atomic adds each
# queue on the same two words: a 1 % delta of Qwen3-8B on one H100 scanned in 17.4-19.1 ms
# with the sums against 14.0-14.9 without (`benchmarks/delta_scan_gpu.py`). Striped, program
# p adds into row p % SUM_STRIPES of its message's scratch, folded into the caller's row by
# one small reduction after the launch (sums modulo 2^64: the order does not matter).
SUM_STRIPES = launch_setting("REFIT_DELTA_SUM_STRIPES", 1, 1, 256)
# Bitmap bytes per block.
BITS = BLOCK // 8
_kernels: Any = None
TL_WORDS: dict[int, Any] = {}


def compile_kernels() -> Any:
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    from refitplane.reshard.triton_rows import WORD_TYPES, popc

    @triton.jit
    def locate(pid, block_msg, blk0, ns, BLOCK: tl.constexpr):
        """This program's message, its block within it, the block's first word (int64) and
        its words as rows of 8 (one bitmap byte each), [rows, 8] int32 offsets from the
        first word, with which of them lie inside the message. Rows keep every step within
        a thread or a 512-long scan (a 1-D 4096-long scan or reshape costs several shared
        memory passes); 32-bit offsets from a 64-bit block start keep register use low (a
        program's latency is hidden only by many programs resident at once)."""
        return place(tl.load(block_msg + pid), pid, blk0, ns, BLOCK)

    @triton.jit
    def place(m, pid, blk0, ns, BLOCK: tl.constexpr):
        """`locate` for a program whose message `m` is already loaded."""
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
    def rows_before(packed):
        """Per row of 8 words (`packed`: its bitmap byte), the words changed in the block's
        earlier rows."""
        per_row = popc(packed)
        return tl.cumsum(per_row, axis=0) - per_row

    @triton.jit
    def column_places(packed, before, col):
        """Column `col` of a block's rows: which of its words changed, and each one's place
        among the block's changed words (`before`, then the set bits below its own in its
        row) — the one order of the gather's payloads and the scan's slots."""
        return ((packed >> col) & 1) != 0, before + popc(packed & ((1 << col) - 1))

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
        UPDATE_ROWS: tl.constexpr = False,
        slot_values=None,
        slot_index=None,
        COMPACT: tl.constexpr = False,
        CAP: tl.constexpr = 1,
        STRIPES: tl.constexpr = 1,
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
        if UPDATE and UPDATE_ROWS:
            # Whole rows (`SCAN_UPDATE`), never past the message's end.
            row = tl.broadcast_to(packed[:, None] != 0, (BLOCK // 8, 8))
            if full:
                tl.store(base + inner, a, mask=row)
            else:
                tl.store(base + inner, a, mask=row & inside)
        if UPDATE and not UPDATE_ROWS:
            tl.store(base + inner, a, mask=changed != 0)
        if SUMS and SUMS_FROM_WORDS:
            out_at = tl.load(sums + m)
            if out_at != 0:
                s0, s1 = folded_sums(a, inner, first, WORD_BYTES, BLOCK)
                out = out_at.to(tl.pointer_type(tl.int64)) + (tl.program_id(0) % STRIPES) * 2
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
                out = out_at.to(tl.pointer_type(tl.int64)) + (tl.program_id(0) % STRIPES) * 2
                tl.atomic_add(out, tl.sum(x, axis=0))
                tl.atomic_add(out + 1, tl.sum(x * (w0 + k), axis=0))
        if COMPACT:
            # This block's changed words in ascending order into its `CAP` slots (`PACK_CAP`),
            # with their word indices in the message; a block with more changed words than
            # slots fills them and is gathered again (`gather`'s PACKED), whole. A changed
            # word's slot is its place in `column_places`, the gather's order, so the payloads
            # are the same bytes. One word
            # column at a time, [rows] vectors, its words read again (from the cache, only
            # where changed), in a loop not unrolled, after the base update and the sums: 71
            # registers per thread on sm_90, as the scan alone (67), where a [rows, 8] slot
            # table took 232 and the columns unrolled 140, too few programs resident to hide
            # the scan's loads (`tests/unit/reshard/test_kernel_registers.py`).
            before = rows_before(packed)
            rows = tl.arange(0, BLOCK // 8)
            out_values = slot_values + tl.program_id(0).to(tl.int64) * CAP
            out_index = slot_index + tl.program_id(0).to(tl.int64) * CAP
            first32 = first.to(tl.int32)
            for col in range(8):
                flagged, rank = column_places(packed, before, col)
                keep = flagged & (rank < CAP)
                word = rows * 8 + col
                tl.store(out_values + rank, tl.load(cur + word, mask=keep, other=0), mask=keep)
                tl.store(out_index + rank, first32 + word, mask=keep)

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
        counts,
        kinds,
        maps,
        map_bytes,
        indexes,
        values,
        WORD: tl.constexpr,
        BLOCK: tl.constexpr,
        PACKED: tl.constexpr = False,
        CAP: tl.constexpr = 1,
    ):
        pid = tl.program_id(0) + first_block
        # A block with nothing changed writes nothing: its payload bytes (index and values,
        # or a bitmap section's zero flags) are the zeros the buffers hold (`prepare_gather`
        # takes zero-filled payloads), so it ends after one load instead of its chain of
        # table loads, bitmap prefix sum and masked passes (a message that did not change
        # at all, a frozen layer, costs ~nothing). Its message and payload start are loaded
        # with the count, before the branch: a changed block waits no longer than before.
        count = tl.load(counts + pid)
        m = tl.load(block_msg + pid)
        start = tl.load(starts + pid)
        if PACKED:
            # An index payload's block whose changed words all fit its slots: `pack`'s.
            count = tl.where((count <= CAP) & (tl.load(kinds + m) == 1), 0, count)
        if count != 0:
            m, local, first, _, _ = place(m, pid, blk0, ns, BLOCK)
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
                before = rows_before(packed)
                cur = tl.load(curs + m).to(tl.pointer_type(WORD)) + first
                out_values = tl.load(values + m).to(tl.pointer_type(WORD)) + start
                # Index payloads only for messages under 2^31 words (`choose_encoding`).
                index = tl.load(indexes + m).to(tl.pointer_type(tl.int32)) + start
                first32 = first.to(tl.int32)
                for k in tl.static_range(8):
                    changed, rank = column_places(packed, before, k)
                    word = rows * 8 + k
                    a = tl.load(cur + word, mask=changed, other=0)
                    if kind == 1:
                        tl.store(index + rank, first32 + word, mask=changed)
                    tl.store(out_values + rank, a, mask=changed)

    # Blocks [first_block, end_block) of a launch, `GROUP` per program.
    @triton.jit(do_not_specialize=["first_block", "end_block"])
    def pack(
        first_block,
        end_block,
        block_msg,
        starts,
        counts,
        kinds,
        indexes,
        values,
        slot_values,
        slot_index,
        WORD: tl.constexpr,
        CAP: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        """Each index payload's block with no more changed words than slots: its filled
        slots (`scan`'s COMPACT) to its place in the payload, index and values."""
        block = first_block + tl.program_id(0) * GROUP + tl.arange(0, GROUP)  # [GROUP]
        inside = block < end_block
        count = tl.load(counts + block, mask=inside, other=0)
        m = tl.load(block_msg + block, mask=inside, other=0)
        kind = tl.load(kinds + m, mask=inside, other=0)
        take = inside & (kind == 1) & (count <= CAP)
        start = tl.load(starts + block, mask=take, other=0)[:, None]
        j = tl.arange(0, CAP)[None, :]
        filled = take[:, None] & (j < count[:, None])  # [GROUP, CAP]
        slot = block.to(tl.int64)[:, None] * CAP + j
        out_values = tl.load(values + m, mask=take, other=0).to(tl.pointer_type(WORD))
        out_index = tl.load(indexes + m, mask=take, other=0).to(tl.pointer_type(tl.int32))
        v = tl.load(slot_values + slot, mask=filled, other=0)
        tl.store(out_values[:, None] + start + j, v, mask=filled)
        i = tl.load(slot_index + slot, mask=filled, other=0)
        tl.store(out_index[:, None] + start + j, i, mask=filled)

    # The kernels call the helpers by name: Triton's interpreter (TRITON_INTERPRET=1, how the
    # CPU tests run these kernels) looks names up in the module's globals.
    globals().update(
        locate=locate,
        place=place,
        popc=popc,
        folded_sums=folded_sums,
        rows_before=rows_before,
        column_places=column_places,
    )
    TL_WORDS.update(WORD_TYPES)
    _kernels = (scan, gather, pack)
    return _kernels
