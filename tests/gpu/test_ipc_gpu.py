"""CUDA IPC transport + executor: two processes on one GPU (colocated) and across two GPUs;
a handle whose sender exited is a clear failure of the receiver, not a crash."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from refitplane.testing import p2p_cases as pc
from refitplane.testing.nccl_world import run_ipc_world

MiB = 1 << 20
# The sender's staging ring: its extra memory for a refit, as on NCCL.
RING_MIB = 256


def _run(gpus: list[int], case_name: str) -> dict[int, tuple[str, dict[str, Any]]]:
    # Two refits: the second reuses the mapped allocations and the executor's views.
    return run_ipc_world(
        pc.refit_worker,
        gpus,
        timeout_s=60,
        case_name=case_name,
        gib=0.5,
        bucket_mib=64,
        ring_mib=RING_MIB,
        refits=2,
    )


def _check(results: dict[int, tuple[str, dict[str, Any]]]) -> None:
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", detail
        assert detail["bytes"] == detail["total"] > 0
    recv = results[1][1]
    assert recv["mismatches"] == []
    assert recv["verified"] == recv["tensors"] > 0
    assert results[0][1]["peak"] <= RING_MIB * MiB


@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ["whole", "tp2"])
def test_two_processes_on_one_gpu_arrive_bit_exact(case_name: str) -> None:
    _check(_run([0, 0], case_name))


@pytest.mark.gpu(count=2)
def test_cross_gpu_ipc_arrives_bit_exact() -> None:
    _check(_run([0, 1], "tp2"))


def _stale_worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    import torch

    from refitplane.errors import RefitError
    from refitplane.reshard.transport.base import P2POp

    if rank == 0:
        buf = torch.full((4 * MiB,), 7, dtype=torch.uint8, device=transport.device)
        transport.issue(0, [P2POp(True, 1, buf)], time.monotonic() + 30)
        time.sleep(0.5)  # the record is on its way (Gloo sends do not block)
        os._exit(0)  # exits with its memory handed out and never acknowledged
    time.sleep(2.0)  # the sender is gone
    out = torch.zeros(4 * MiB, dtype=torch.uint8, device=transport.device)
    try:
        handle = transport.issue(0, [P2POp(False, 0, out)], time.monotonic() + 5)
        transport.wait(handle, time.monotonic() + 5)
    except RefitError as exc:
        transport.abort()
        return {"error": type(exc).__name__, "message": exc.message, "_aborted": True}
    return {"error": None, "sevens": int((out == 7).sum())}


@pytest.mark.gpu
def test_handle_of_an_exited_sender_is_a_refit_error() -> None:
    results = run_ipc_world(_stale_worker, [0, 0], timeout_s=20)
    status, detail = results[1]
    assert status == "ok", detail  # the receiver did not crash
    assert detail["error"] is not None, detail
    assert "rank 0" in detail["message"] or "CUDA IPC" in detail["message"], detail
