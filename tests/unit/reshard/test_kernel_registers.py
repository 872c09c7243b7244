"""Registers per thread of the data plane's Triton kernels on Hopper, checked without a GPU:
each kernel compiled for sm_90 at its launch shape, assembled by the ptxas Triton uses there
(`triton_hopper.registers_on_hopper`), against a budget.

A kernel's registers decide how many of its programs an SM holds at once (65,536 registers,
allocated per warp in steps of 8 per thread), and these kernels are memory-bound: a program
waiting on its loads is hidden only by the others resident. Each budget is the most registers
that keep the residency the kernel has now; going over it is a regression found here, not on
a GPU. Found this way (2026-11-27): the receivers' delta apply used 254 registers (two
programs per SM for a kernel of dependent random loads; 79 after its index loop went by
chunks and its bitmap loop stopped being unrolled), and the sender's scan with slots 140
(71 with its column loop not unrolled; the scan alone 67).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import pytest

from refitplane.reshard import delta_kernels
from tests.unit.reshard.triton_hopper import registers_on_hopper


def _cuda_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends import backends

    return "nvidia" in backends


pytestmark = pytest.mark.skipif(not _cuda_backend(), reason="needs Triton's CUDA backend")

REGISTERS_PER_SM = 65536


def resident(registers: int, warps: int) -> int:
    """Programs of `warps` warps an SM holds at `registers` per thread (registers alone; at
    most 64 warps)."""
    per_warp = (registers + 7) // 8 * 8 * 32
    return min(REGISTERS_PER_SM // (per_warp * warps), 64 // warps)


class Case(NamedTuple):
    kernel: Callable[[], Any]
    args: Mapping[str, str]
    constexprs: Callable[[], Mapping[str, Any]]
    warps: int
    budget: int


def _delta_kernel(index: int) -> Callable[[], Any]:
    def get() -> Any:
        from refitplane.reshard import delta_kernels

        return delta_kernels.compile_kernels()[index]

    return get


def _apply_kernel(index: int) -> Callable[[], Any]:
    def get() -> Any:
        from refitplane.reshard import delta_apply

        return delta_apply._compile()[index]

    return get


def _scan_settings(**settings: Any) -> Callable[[], Mapping[str, Any]]:
    """The sender's scan as `delta_batch.scan_many` launches it (bf16 words, base advanced by
    rows, sums taken), with `settings` on top."""

    def get() -> Mapping[str, Any]:
        import triton.language as tl

        from refitplane.reshard import delta_kernels

        shape = {"UPDATE": True, "WORD": tl.int16, "WORD_BYTES": 2, "BLOCK": delta_kernels.BLOCK}
        return shape | {"ALIGNED": True, "SUMS": True, "UPDATE_ROWS": True} | settings

    return get


def _word_settings(**settings: Any) -> Callable[[], Mapping[str, Any]]:
    def get() -> Mapping[str, Any]:
        import triton.language as tl

        return {"WORD": tl.int16, **settings}

    return get


def _module_settings(module: str, **extra: Any) -> Callable[[], Mapping[str, Any]]:
    """A table-driven kernel's launch shape, from its module's constants."""

    def get() -> Mapping[str, Any]:
        found = importlib.import_module(f"refitplane.reshard.{module}")
        shape = {"BLOCK": found._BLOCK, "ITERS": found._ITERS, "STEPS": found._SEARCH_STEPS}
        return shape | extra

    return get


def _kernel_of(module: str, name: str) -> Callable[[], Any]:
    return lambda: getattr(importlib.import_module(f"refitplane.reshard.{module}"), name)()


SCAN_ARGS = {"block_msg": "*i32", "blk0": "*i64", "ns": "*i64", "curs": "*i64", "bases": "*i64"}
SCAN_ARGS |= {"bits_at": "*i64", "bits": "*u8", "counts": "*i32", "sums": "*i64"}
SLOTS = {"slot_values": "*i16", "slot_index": "*i32"}
GATHER_ARGS = {"first_block": "i64", "block_msg": "*i32", "blk0": "*i64", "ns": "*i64"}
GATHER_ARGS |= {"curs": "*i64", "bits_at": "*i64", "bits": "*u8", "starts": "*i64"}
GATHER_ARGS |= {"counts": "*i32", "kinds": "*i32", "maps": "*i64", "map_bytes": "*i64"}
GATHER_ARGS |= {"indexes": "*i64", "values": "*i64"}
PACK_ARGS = {"first_block": "i64", "end_block": "i64", "block_msg": "*i32", "starts": "*i64"}
PACK_ARGS |= {"counts": "*i32", "kinds": "*i32", "indexes": "*i64", "values": "*i64", **SLOTS}
TABLE = {"tab": "*i64", "n": "i64"}


def _apply_settings() -> Mapping[str, Any]:
    import triton.language as tl

    from refitplane.reshard import delta_apply

    shape = {"ROW": delta_apply.ROW, "BLOCK": delta_apply.BLOCK, "STEPS": 20}
    return shape | {"WORD": tl.int16, "WORD_BYTES": 2, "CHUNK": delta_apply.INDEX_CHUNK}


CASES = {
    # Senders of delta refits (`delta_batch`): 7 programs of 4 warps per SM.
    "delta scan": Case(_delta_kernel(0), SCAN_ARGS, _scan_settings(), 4, 72),
    "delta scan, sums striped": Case(
        _delta_kernel(0), SCAN_ARGS, _scan_settings(STRIPES=32), 4, 72
    ),
    "delta scan, slots": Case(
        _delta_kernel(0), SCAN_ARGS | SLOTS, _scan_settings(COMPACT=True, CAP=64), 4, 72
    ),
    "delta scan, slots, 8 warps": Case(
        _delta_kernel(0), SCAN_ARGS | SLOTS, _scan_settings(COMPACT=True, CAP=64), 8, 64
    ),
    "delta gather": Case(_delta_kernel(1), GATHER_ARGS, _word_settings(BLOCK=4096), 4, 40),
    "delta pack": Case(
        _delta_kernel(2),
        PACK_ARGS,
        _word_settings(CAP=64, GROUP=delta_kernels.PACK_GROUP),
        delta_kernels.PACK_WARPS,
        48,
    ),
    # Receivers of delta refits (`delta_apply`): 6 programs per SM.
    "delta apply": Case(_apply_kernel(2), TABLE, _apply_settings, 4, 80),
    # Every refit: checksums (8 per SM), a colocated receiver's copy that checksums (6), the
    # staging pack and unpack (12; 5 with sums).
    "checksum": Case(
        _kernel_of("checksum", "_triton_kernel"), TABLE, _module_settings("checksum"), 4, 64
    ),
    "copy and sums": Case(
        _kernel_of("copy_sums", "triton_kernel"),
        {"tab": "*i64", "n": "i32"},
        _module_settings("copy_sums", ROW=5, ALIGNED=True),
        4,
        80,
    ),
    "chunk copy": Case(
        _kernel_of("chunk_copy", "triton_kernel"),
        {"tab": "*i64", "n": "i32", "buf": "*u8", "out": "*i64"},
        _module_settings("chunk_copy", SCATTER=False, SUMS=False),
        4,
        40,
    ),
    "chunk copy with sums": Case(
        _kernel_of("chunk_copy", "triton_kernel"),
        {"tab": "*i64", "n": "i32", "buf": "*u8", "out": "*i64"},
        _module_settings("chunk_copy", SCATTER=False, SUMS=True),
        4,
        96,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_registers_stay_within_budget(name: str) -> None:
    case = CASES[name]
    registers = registers_on_hopper(case.kernel(), case.args, case.constexprs(), case.warps)
    programs = resident(registers, case.warps)
    print(f"[registers] {name}: {registers} per thread, {programs} programs per SM")
    assert registers <= case.budget, (
        f"{name}: {registers} registers per thread, budget {case.budget} "
        f"({resident(case.budget, case.warps)} programs of {case.warps} warps per SM; now "
        f"{programs})"
    )


def test_residency_arithmetic() -> None:
    # 4 warps: 64 registers hold 8 programs, 65-72 hold 7, 254 hold 2.
    assert [resident(r, 4) for r in (64, 65, 72, 254)] == [8, 7, 7, 2]
    assert resident(40, 4) == 12
    assert resident(16, 4) == 16  # the 64-warp cap
