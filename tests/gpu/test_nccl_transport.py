"""nccl4py transport + executor between two GPUs: 4+ GiB bf16, whole and TP2 splits."""

from __future__ import annotations

import time
from typing import Any

import pytest

from refitplane.testing import p2p_cases as pc
from refitplane.testing.nccl_world import run_nccl_world

pytestmark = [pytest.mark.gpu(count=2)]

MiB = 1 << 20


@pytest.mark.parametrize("case_name", ["whole", "tp2"])
def test_four_gib_bf16_arrives_bit_exact(case_name: str) -> None:
    results = run_nccl_world(
        pc.refit_worker, 2, channels=2, timeout_s=150, case_name=case_name, gib=4.25
    )
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", detail
        assert detail["bytes"] == detail["total"] >= 4 * 2**30
    recv = results[1][1]
    assert recv["mismatches"] == []
    assert recv["verified"] == recv["tensors"] > 0
    assert recv["peak"] <= 1024 * MiB


def _stall_worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    from refitplane.errors import TransferTimeout
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor
    from refitplane.testing import p2p_cases as pc

    case = pc.make_case("whole", 0.25)
    if rank == 0:
        time.sleep(8)  # never sends
        transport.abort()
        return {"_aborted": True}
    shards = pc.make_shards(case.target, 1, transport.device, fill=False)
    started = time.monotonic()
    try:
        Executor(transport, TransferConfig(timeout_s=3)).run(pc.rank_plan(case, 1), shards)
    except TransferTimeout:
        return {"timed_out_after": time.monotonic() - started, "_aborted": True}
    return {"timed_out_after": None}


def test_stalled_sender_times_out_receiver() -> None:
    results = run_nccl_world(_stall_worker, 2, channels=2, timeout_s=60)
    status, detail = results[1]
    assert status == "ok", detail
    assert detail["timed_out_after"] is not None
    assert detail["timed_out_after"] < 10
