"""Functions a refit world's driver runs inside vLLM workers, through a replica's "rpc"
command (`llm.collective_rpc`): what the benchmark measures there."""

from __future__ import annotations

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
