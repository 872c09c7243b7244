"""CUDA IPC transport + executor: two processes on one GPU (colocated) and across two GPUs,
through link copies (one manifest, the receiver's copies, one completion: `ipc_run.py`) and
through messages (what staged receivers take); the sender's weights changing between
refits; a handle whose sender exited is a clear failure of the receiver, not a crash."""

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
@pytest.mark.parametrize("case_name", ["whole", "tp2", "tp2-messages"])
def test_two_processes_on_one_gpu_arrive_bit_exact(
    case_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if case_name.endswith("-messages"):
        # Messages (records, acknowledgements, the sender's ring), as staged receivers take
        # them: both spawned ranks read the switch at import.
        monkeypatch.setenv("REFIT_IPC_LINK_COPIES", "0")
    _check(_run([0, 0], case_name.removesuffix("-messages")))


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


def _changing_worker(
    *, rank: int, world: int, transport: Any, barrier: Any, case_name: str
) -> dict[str, Any]:
    """Three refits of link copies, the sender's weights changed in place before each: the
    receiver's cached views (same manifest) must copy the new bytes every time."""
    import torch

    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor

    case = pc.make_case(case_name, 0.25)
    layout = case.source if rank == 0 else case.target
    shards = pc.make_shards(layout, rank, transport.device, fill=rank == 0)
    executor = Executor(transport, TransferConfig(bucket_bytes=64 * MiB, timeout_s=60))
    wrong = []
    for value in (3, 5, 250):
        if rank == 0:
            for sv in shards:
                sv.tensor.view(torch.uint8).fill_(value)
        report = executor.run(pc.rank_plan(case, rank), shards)
        if rank == 1:
            torch.cuda.synchronize()
            if report.tensors_verified != report.tensors_total:
                wrong.append(f"refit {value}: {report.tensors_verified} verified")
            for sv in shards:
                if not bool((sv.tensor.view(torch.uint8) == value).all()):
                    wrong.append(f"refit {value}: {sv.spec.name}")
    return {"wrong": wrong[:5], "groups": report.groups, "staging": report.staging_peak_bytes}


@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ["whole", "tp2"])
def test_link_copies_follow_the_senders_changes(case_name: str) -> None:
    results = run_ipc_world(_changing_worker, [0, 0], timeout_s=60, case_name=case_name)
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", detail
        assert detail["wrong"] == [], detail
        assert detail["staging"] == 0, detail  # link copies stage nothing on either end


def _realloc_worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    """Six refits of link copies; the sender's tensors are new allocations each time (a
    trainer that offloads its parameters between steps): its shares of the old ones are let
    go once the receiver moved on, so its GPU memory does not grow refit after refit."""
    import torch

    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor

    case = pc.make_case("whole", 0.25)
    layout = case.source if rank == 0 else case.target
    executor = Executor(transport, TransferConfig(bucket_bytes=64 * MiB, timeout_s=60))
    receiver = pc.make_shards(layout, 1, transport.device, fill=False) if rank == 1 else None
    allocated, wrong = [], []
    for value in range(1, 7):
        if rank == 0:
            shards = pc.make_shards(layout, 0, transport.device, fill=False)
            for sv in shards:
                sv.tensor.view(torch.uint8).fill_(value)
        else:
            assert receiver is not None
            shards = receiver
        executor.run(pc.rank_plan(case, rank), shards)
        del shards
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        allocated.append(torch.cuda.memory_allocated())
        if receiver is not None:
            wrong += [
                f"refit {value}"
                for sv in receiver
                if not bool((sv.tensor.view(torch.uint8) == value).all())
            ]
    return {"allocated": allocated, "wrong": wrong[:5], "case_bytes": case.total_bytes}


@pytest.mark.gpu
def test_a_sender_that_reallocates_its_weights_does_not_grow() -> None:
    results = run_ipc_world(_realloc_worker, [0, 0], timeout_s=90)
    for rank in (0, 1):
        assert results[rank][0] == "ok", results[rank]
    assert results[1][1]["wrong"] == [], results[1]
    sender = results[0][1]
    # Without letting go, every refit would keep one more copy of the weights alive.
    growth = sender["allocated"][-1] - sender["allocated"][1]
    assert growth <= sender["case_bytes"], sender


def _stale_link_worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    """A refit of link copies, then the sender exits: the receiver's next refit must not
    copy through the mappings it kept (the sender's memory is gone) but fail clearly."""
    from refitplane.errors import RefitError
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor

    case = pc.make_case("whole", 0.125)
    layout = case.source if rank == 0 else case.target
    shards = pc.make_shards(layout, rank, transport.device, fill=rank == 0)
    executor = Executor(transport, TransferConfig(bucket_bytes=64 * MiB, timeout_s=10))
    executor.run(pc.rank_plan(case, rank), shards)
    if rank == 0:
        os._exit(0)  # its memory goes with it; the receiver still holds the mappings
    time.sleep(2.0)
    try:
        executor.run(pc.rank_plan(case, 1), shards)
    except RefitError as exc:
        return {"error": type(exc).__name__, "message": exc.message, "_aborted": True}
    return {"error": None}


@pytest.mark.gpu
@pytest.mark.parametrize("worker", [_stale_worker, _stale_link_worker], ids=["message", "link"])
def test_handle_of_an_exited_sender_is_a_refit_error(worker: Any) -> None:
    """A record's sender exits before the receiver opens it (messages: staged receivers), or
    a link's sender exits between refits (link copies: the receiver keeps its mappings)."""
    results = run_ipc_world(worker, [0, 0], timeout_s=30)
    status, detail = results[1]
    assert status == "ok", detail  # the receiver did not crash
    assert detail["error"] is not None, detail
    assert "rank 0" in detail["message"] or "CUDA IPC" in detail["message"], detail


def _sender_and_receiver(worker: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run `worker` as a sender (rank 0) and a receiver (rank 1) on GPU 0; both must end."""
    results = run_ipc_world(worker, [0, 0], timeout_s=60)
    for rank in (0, 1):
        assert results[rank][0] == "ok", results[rank]
    return results[0][1], results[1][1]


def _write_after_the_sums(transport: Any, shards: Any, value: int) -> None:
    """Change the sender's weights once its sums are taken, as a writer that ignores the
    refit's hold would."""
    import torch

    transport.sum_stream().synchronize()
    for sv in shards:
        sv.tensor.view(torch.uint8).fill_(value)


def _refit_and_check(
    executor: Any, plan: Any, shards: Any, rank: int, refit: int, value: int, out: dict[str, Any]
) -> bool:
    """Run one refit of link copies; on the receiver, check every byte arrived as `value`
    and was verified (into `out["wrong"]`). False when the receiver's sums did not match
    (`out` then names the refit and the message)."""
    import torch

    from refitplane.errors import ChecksumMismatch

    try:
        report = executor.run(plan, shards)
    except ChecksumMismatch as exc:
        out.update(error=f"refit {refit}", message=exc.message, _aborted=True)
        return False
    if rank == 1:
        torch.cuda.synchronize()
        if report.tensors_verified != report.tensors_total:
            out["wrong"].append(f"refit {refit}: {report.tensors_verified} verified")
        out["wrong"] += [
            f"refit {refit}: {sv.spec.name}"
            for sv in shards
            if not bool((sv.tensor.view(torch.uint8) == value).all())
        ]
    return True


def _presum_worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    """Three refits of link copies; from the second on the sender checksums its chunks when
    the refit is prepared (`Executor.presum_links`, what a trainer does at PrepareRefit).
    Refit 2 keeps the weights: they arrive verified. Refit 3 changes them after the sums
    (a hold that expired): the receiver's sums of what it copied must not match."""
    import torch

    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor

    case = pc.make_case("tp2", 0.25)
    layout = case.source if rank == 0 else case.target
    shards = pc.make_shards(layout, rank, transport.device, fill=False)
    executor = Executor(transport, TransferConfig(bucket_bytes=64 * MiB, timeout_s=60))
    plan = pc.rank_plan(case, rank)
    out: dict[str, Any] = {"presummed": [], "wrong": []}
    for refit, value in enumerate((3, 5, 7), start=1):
        if rank == 0:
            for sv in shards:
                sv.tensor.view(torch.uint8).fill_(value)
            out["presummed"].append(executor.presum_links(plan, shards))
            if refit == 3:
                _write_after_the_sums(transport, shards, value + 1)
        barrier.wait()
        if not _refit_and_check(executor, plan, shards, rank, refit, value, out):
            return out
    out["_aborted"] = rank == 0  # its receiver aborted after refit 3
    return out


@pytest.mark.gpu
def test_sums_taken_at_prepare_catch_weights_changed_after_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REFIT_IPC_PRESUM", "1")  # the default, whatever the caller's env says
    sender, receiver = _sender_and_receiver(_presum_worker)
    # The group agrees on link copies at its first transfer: sums at prepare from then on.
    assert sender["presummed"] == [False, True, True], sender
    assert receiver["wrong"] == [], receiver
    assert receiver.get("error") == "refit 3", receiver
    assert "checksum" in receiver["message"], receiver


def _step_sums_worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    """Refits of link copies where the sender's sums are taken at the end of each optimizer
    step (`presum_links(after_step=True)`, what `TrainerAgent.updating_weights` does) and
    the prepare passes the weights' write count. Refit 1 agrees on link copies. Refit 2:
    the step's sums are kept at prepare (no second launch) and verify. Refit 3: another
    write began after the step's sums (count 3, not 2): the prepare takes them again, and
    they verify. Refit 4: the weights change after the step's sums without a write hold (a
    caller breaking the contract): the prepare keeps the sums (same count) and the
    receiver's sums of what it copied must not match."""
    import torch

    from refitplane.reshard import ipc_run
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor

    launches = [0]
    launch = ipc_run._launch_sums

    def counted(transport: Any, links: Any, budget: int) -> None:
        launches[0] += 1
        launch(transport, links, budget)

    ipc_run._launch_sums = counted
    case = pc.make_case("tp2", 0.25)
    layout = case.source if rank == 0 else case.target
    shards = pc.make_shards(layout, rank, transport.device, fill=False)
    executor = Executor(transport, TransferConfig(bucket_bytes=64 * MiB, timeout_s=60))
    plan = pc.rank_plan(case, rank)
    out: dict[str, Any] = {"step": [], "prepare": [], "launches": [], "wrong": []}
    # (value written by the step, write count at the step's end, count at prepare)
    for refit, (value, step_writes, prepare_writes) in enumerate(
        ((3, None, None), (5, 2, 2), (7, 2, 3), (9, 4, 4)), start=1
    ):
        if rank == 0:
            for sv in shards:
                sv.tensor.view(torch.uint8).fill_(value)
            if step_writes is not None:
                out["step"].append(
                    executor.presum_links(plan, shards, writes=step_writes, after_step=True)
                )
            before = launches[0]
            if refit == 4:
                _write_after_the_sums(transport, shards, value + 1)
            out["prepare"].append(executor.presum_links(plan, shards, writes=prepare_writes))
            out["launches"].append(launches[0] - before)
        barrier.wait()
        if not _refit_and_check(executor, plan, shards, rank, refit, value, out):
            return out
    out["_aborted"] = rank == 0  # its receiver aborted after refit 4
    return out


@pytest.mark.gpu
def test_sums_taken_at_the_end_of_a_step_serve_the_next_refit_until_a_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REFIT_IPC_PRESUM", "1")
    sender, receiver = _sender_and_receiver(_step_sums_worker)
    # Steps before refits 2, 3 and 4 took sums (link copies agreed at refit 1).
    assert sender["step"] == [True, True, True], sender
    # Refit 1: no link copies agreed yet, nothing launched. Refit 2: the step's sums kept.
    # Refit 3: a later write: taken again. Refit 4: kept (same count), then found stale.
    assert sender["prepare"] == [False, True, True, True], sender
    assert sender["launches"] == [0, 0, 1, 0], sender
    assert receiver["wrong"] == [], receiver
    assert receiver.get("error") == "refit 4", receiver
    assert "checksum" in receiver["message"], receiver


@pytest.mark.gpu
def test_the_copy_kernel_copies_and_checksums_exactly_on_cuda() -> None:
    """The receiver's copy kernel, both variants (16-byte aligned and not), against `copy_`
    and the torch checksum reference, compiled for this GPU."""
    from refitplane.reshard import copy_sums

    copy_sums.check("cuda")
