"""A real multi-GPU world for tests and benchmarks: one spawned process per rank, each with
an `NcclTransport` (one GPU per rank) or a `CudaIpcTransport` (ranks may share a GPU) over a
rendezvous the parent mints. GPU machines only."""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Callable
from typing import Any

from refitplane.testing.process_world import SAFE_ENV, barrier_for, spawn_and_collect

for _k, _v in SAFE_ENV.items():
    os.environ.setdefault(_k, _v)

Worker = Callable[..., dict[str, Any]]


def _entry(
    worker: Worker,
    rank: int,
    world: int,
    blob: bytes,
    channels: int,
    timeout_s: float,
    barrier: Any,
    kwargs: dict[str, Any],
    out: Any,
    gpus: list[int] | None = None,
) -> None:
    os.environ.update(SAFE_ENV)
    # A rank still running when the parent is about to give up prints where it is stuck.
    faulthandler.dump_traceback_later(timeout_s + 30, exit=False)
    import torch

    from refitplane.reshard.transport.nccl import NcclTransport

    try:
        device = torch.device("cuda", rank if gpus is None else gpus[rank])
        torch.cuda.set_device(device)
        transport: Any
        if gpus is None:
            transport = NcclTransport(
                rank, world, blob, device=device, num_channels=channels, timeout_s=timeout_s
            )
        else:
            from refitplane.reshard.transport.cuda_ipc import CudaIpcTransport
            from refitplane.reshard.transport.gloo import GlooTransport

            control = GlooTransport(rank, world, blob, num_channels=channels, timeout_s=timeout_s)
            transport = CudaIpcTransport(control, device=device)
        result = worker(rank=rank, world=world, transport=transport, barrier=barrier, **kwargs)
        if not result.pop("_aborted", False):
            transport.close()
        out.put((rank, "ok", result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        out.put((rank, "error", {"type": type(exc).__name__, "message": str(exc)}))


def run_nccl_world(
    worker: Worker, world: int, *, channels: int = 4, timeout_s: float = 300.0, **kwargs: Any
) -> dict[int, tuple[str, dict[str, Any]]]:
    """Run `worker(rank=, world=, transport=, barrier=, **kwargs)` on GPUs 0..world-1."""
    from refitplane.reshard.transport.nccl import create_nccl_rendezvous

    blob = create_nccl_rendezvous(channels)
    barrier = barrier_for(world, timeout_s)
    return spawn_and_collect(
        _entry,
        lambda r, out: (worker, r, world, blob, channels, timeout_s, barrier, kwargs, out),
        world,
        timeout_s + 60,
    )


def run_ipc_world(
    worker: Worker,
    gpus: list[int],
    *,
    channels: int = 2,
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> dict[int, tuple[str, dict[str, Any]]]:
    """Run `worker(rank=, world=, transport=, barrier=, **kwargs)` with rank r on GPU
    `gpus[r]` over CUDA IPC ([0, 0]: two ranks on one GPU)."""
    from refitplane.reshard.transport.gloo import create_gloo_rendezvous

    world = len(gpus)
    store, blob = create_gloo_rendezvous("127.0.0.1", world, timeout_s)
    barrier = barrier_for(world, timeout_s)
    try:
        return spawn_and_collect(
            _entry,
            lambda r, out: (
                worker,
                r,
                world,
                blob,
                channels,
                timeout_s,
                barrier,
                kwargs,
                out,
                gpus,
            ),
            world,
            timeout_s + 60,
        )
    finally:
        del store


def ranks_or_report(
    results: dict[int, tuple[str, dict[str, Any]]], world: int
) -> list[dict[str, Any]] | None:
    """Every rank's result in rank order; None (after printing what failed) if any rank
    failed or never reported."""
    missing = [r for r in range(world) if r not in results]
    for rank in missing:
        print(f"rank {rank} never reported", file=sys.stderr)
    failed = [(r, d) for r, (status, d) in sorted(results.items()) if status != "ok"]
    for rank, detail in failed:
        print(f"rank {rank} failed: {detail}", file=sys.stderr)
    if missing or failed:
        return None
    return [results[r][1] for r in range(world)]
