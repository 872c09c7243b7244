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


def forked_from_server(preload: Sequence[str] = ("torch",)) -> Any:
    """The forkserver start method with `preload` imported once in its server: each rank then
    starts in ~10 ms instead of the ~1.5 s (3 s on a loaded 2-core box) a spawned interpreter
    spends importing torch, which made process start-up the bulk of CPU Gloo worlds' time.
    The server keeps the environment it started with: ranks see later changes only through
    their arguments (GPU worlds, which set NCCL's environment per world, spawn)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # no effect once the server runs
    return ctx


def spawn_and_collect(
    target: Callable[..., None],
    args_for_rank: Callable[[int, Any], Sequence[Any]],
    world: int,
    timeout_s: float,
    *,
    context: Any = None,
) -> Results:
    """Start `target(*args_for_rank(rank, out))` for every rank (spawned, or from `context`:
    `forked_from_server()`); each puts one `(rank, status, detail)` on `out`. Ranks that
    die without reporting are absent."""
    ctx = context or mp.get_context("spawn")
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
