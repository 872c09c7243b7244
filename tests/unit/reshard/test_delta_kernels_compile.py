"""The delta kernels compile for a GPU, checked without one: Triton's CUDA backend (with its
bundled ptxas) compiles each kernel of `delta_batch` and `delta_apply` for sm_90 from CPU.

Triton's interpreter, which runs the kernels in the other CPU tests, accepts code the
compiler refuses: on 2026-11-26 a scatter whose two branches gave one name vectors of
different lengths passed every interpreter test and failed to compile on the first GPU."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.unit.reshard.triton_hopper import compiles_for_hopper


def _cuda_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends import backends

    return "nvidia" in backends


pytestmark = pytest.mark.skipif(not _cuda_backend(), reason="needs Triton's CUDA backend")


# The sender's launch shapes: the default, and the largest `benchmarks/delta_scan_gpu.py`
# sweeps (REFIT_DELTA_SCAN_BLOCK, REFIT_DELTA_SCAN_WARPS).
@pytest.mark.parametrize(("block", "warps"), [(None, None), (16384, 16)])
def test_the_senders_kernels_compile(block: int | None, warps: int | None) -> None:
    import triton.language as tl

    from refitplane.reshard import delta_kernels

    block = block or delta_kernels.BLOCK
    warps = warps or delta_kernels.SCAN_WARPS
    scan, gather, pack = delta_kernels.compile_kernels()
    tables = {"block_msg": "*i32", "blk0": "*i64", "ns": "*i64", "curs": "*i64"}
    tables |= {"bits_at": "*i64", "bits": "*u8"}
    writes = {**tables, "bases": "*i64", "counts": "*i32", "sums": "*i64"}
    slots = {"slot_values": "*i16", "slot_index": "*i32"}

    def scan_variant(word: int = 2, **settings: Any) -> None:
        """The sender's scan (base advanced, sums taken) with `settings` on top."""
        words = {2: tl.int16, 4: tl.int32}
        shape = {"UPDATE": True, "WORD": words[word], "WORD_BYTES": word, "BLOCK": block}
        compiles_for_hopper(
            scan, {**writes, **slots}, shape | {"ALIGNED": True, "SUMS": True} | settings, warps
        )

    scan_variant()
    # The checksum sums from the words already loaded (REFIT_DELTA_SCAN_SUMS=words).
    for word in (2, 4):
        scan_variant(word, SUMS_FROM_WORDS=True)
    # The base advanced row by row (REFIT_DELTA_SCAN_UPDATE=rows): one 16-byte store per row
    # of 8 bf16 words, not a predicated 2-byte store per word.
    scan_variant(UPDATE_ROWS=True)
    # The changed words compacted into slots (REFIT_DELTA_PACK_CAP), the gather leaving the
    # blocks that fit them to `pack`; the sums spread over stripes (REFIT_DELTA_SUM_STRIPES),
    # both ways of taking them.
    scan_variant(UPDATE_ROWS=True, COMPACT=True, CAP=64)
    for from_words in (False, True):
        scan_variant(SUMS_FROM_WORDS=from_words, STRIPES=32)
    # The sampled estimate's launch (`sample_changed`): nothing written but scratch.
    for aligned in (True, False):
        compiles_for_hopper(
            scan,
            {**tables, "bases": "*i64", "counts": "*i32", "sums": "*i32"},
            {"UPDATE": False, "WORD": tl.int16, "WORD_BYTES": 2, "BLOCK": block}
            | {"ALIGNED": aligned, "SUMS": False},
            warps,
        )
    per_message = ("kinds", "maps", "map_bytes", "indexes", "values", "starts")
    gather_tables = {**tables, "first_block": "i64", "kinds": "*i32", "counts": "*i32"}
    gather_tables |= {name: "*i64" for name in per_message if name != "kinds"}
    compiles_for_hopper(gather, gather_tables, {"WORD": tl.int16, "BLOCK": block})
    compiles_for_hopper(
        gather, gather_tables, {"WORD": tl.int16, "BLOCK": block, "PACKED": True, "CAP": 64}
    )
    compiles_for_hopper(
        pack,
        {"first_block": "i64", "end_block": "i64", "block_msg": "*i32", "starts": "*i64"}
        | {"counts": "*i32", "kinds": "*i32", "indexes": "*i64", "values": "*i64", **slots},
        {"WORD": tl.int16, "CAP": 64, "GROUP": delta_kernels.PACK_GROUP},
    )


@pytest.mark.parametrize("word", [2, 4])
def test_the_receivers_kernels_compile(word: int) -> None:
    import triton.language as tl

    from refitplane.reshard import delta_apply

    popcount, prefix, scatter = delta_apply._compile()
    shape = {"ROW": delta_apply.ROW, "BLOCK": delta_apply.BLOCK}
    compiles_for_hopper(popcount, {"tab": "*i64", "n": "i64"}, {"STEPS": 20, **shape})
    compiles_for_hopper(prefix, {"tab": "*i64"}, {"CHUNK": 1024, **shape})
    words = {2: tl.int16, 4: tl.int32}
    compiles_for_hopper(
        scatter,
        {"tab": "*i64", "n": "i64"},
        {"WORD": words[word], "WORD_BYTES": word, "STEPS": 20, **shape}
        | {"CHUNK": delta_apply.INDEX_CHUNK},
    )
