"""Spawn a real multi-process Gloo world and collect each rank's result."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import TCPStore

from refitplane.testing.process_world import forked_from_server, spawn_and_collect

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
    """Run `worker(rank=, world=, port=, **kwargs)` in `world` processes (forked from a
    server that imported torch once: `forked_from_server`).

    The parent hosts the rendezvous store. Ranks that die without reporting are absent
    from the result. Every process is gone when this returns.
    """
    store = TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    port = store.port
    return spawn_and_collect(
        _entry,
        lambda r, out: (worker, r, world, port, kwargs, out),
        world,
        timeout_s,
        context=forked_from_server(),
    )
