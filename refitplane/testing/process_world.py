"""Spawn one process per rank, collect what each reports, and make sure none outlives the
call; stop a child and its process group. The shared mechanics of the Gloo (CPU), NCCL (GPU)
and refit worlds."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

Results = dict[int, tuple[str, dict[str, Any]]]

# Never let NCCL, PyTorch or NVSHMEM use NVLink multicast on shared hosts: the GPU worlds
# set these before anything loads NCCL, in the parent and in every child.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def spawn_and_collect(
    target: Callable[..., None],
    args_for_rank: Callable[[int, Any], Sequence[Any]],
    world: int,
    timeout_s: float,
) -> Results:
    """Start `target(*args_for_rank(rank, out))` for every rank; each puts one
    `(rank, status, detail)` on `out`. Ranks that die without reporting are absent."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=tuple(args_for_rank(r, out)), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: Results = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, detail = out.get(timeout=0.5)
                results[rank] = (status, detail)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results


def barrier_for(world: int, timeout_s: float) -> Any:
    return mp.get_context("spawn").Barrier(world, timeout=timeout_s)


def stop_process(p: Any, timeout_s: float = 60) -> None:
    """Join a child, then kill whatever is left of its process group (vLLM's children)."""
    p.join(timeout=timeout_s)
    if p.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    if p.is_alive():
        p.kill()
        p.join(timeout=10)
