"""Spawn a real multi-process Gloo world and collect each rank's result."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import TCPStore

Worker = Callable[..., dict[str, Any]]


def _entry(
    worker: Worker, rank: int, world: int, port: int, kwargs: dict[str, Any], out: Any
) -> None:
    try:
        result = worker(rank=rank, world=world, port=port, **kwargs)
        out.put((rank, "ok", result))
    except BaseException as exc:  # report everything to the parent, which asserts on it
        out.put((rank, "error", {"type": type(exc).__name__, "message": str(exc)}))


def run_world(
    worker: Worker, world: int, *, timeout_s: float = 120.0, **kwargs: Any
) -> dict[int, tuple[str, dict[str, Any]]]:
    """Run `worker(rank=, world=, port=, **kwargs)` in `world` spawned processes.

    The parent hosts the rendezvous store. Ranks that die without reporting are absent
    from the result. Every process is gone when this returns.
    """
    ctx = mp.get_context("spawn")
    store = TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(worker, r, world, store.port, kwargs, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, dict[str, Any]]] = {}
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
        del store
    return results
