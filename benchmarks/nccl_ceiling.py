"""The raw NCCL ceiling of a refit plan, for the GPU benchmarks (`gpu_refit.py`,
`delta_refit_gpu.py`): the plan's bytes per (trainer GPU, generator GPU) link
(`plan_links`), nccl4py send/recv of exactly those bytes on every link at once, one group
per rank in 1 GiB messages (`raw_ceiling`, `measure_ceiling`), and the bandwidth per
destination GPU a time means (`per_dest_gbs`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from refitplane.testing.model_layouts import GpuLayout


def plan_links(shape: str, layout: GpuLayout, quant: str = "") -> dict[tuple[int, int], int]:
    """The plan's bytes per (trainer GPU, generator GPU) link (layouts: `model_layouts`)."""
    from refitplane.reshard.planner import build_plan
    from refitplane.testing.model_layouts import model_layouts

    plan = build_plan(*model_layouts(shape, layout, quant))
    return {(link.src, link.dst): link.nbytes for link in plan.links}


def _ceiling_worker(
    *, rank: int, world: int, transport: Any, barrier: Any, links: dict[str, int], repeats: int
) -> dict[str, Any]:
    import torch

    from refitplane.reshard.transport.base import P2POp

    ops_spec = []
    for key, nbytes in sorted(links.items()):
        src, dst = (int(x) for x in key.split(">"))
        if rank in (src, dst):
            ops_spec.append((rank == src, dst if rank == src else src, nbytes))
    bufs = [torch.empty(n, dtype=torch.uint8, device=transport.device) for _, _, n in ops_spec]
    times = []
    for _ in range(repeats + 1):
        ops = []
        for (send, peer, n), buf in zip(ops_spec, bufs, strict=True):
            ops += [P2POp(send, peer, buf[o : o + (1 << 30)]) for o in range(0, n, 1 << 30)]
        torch.cuda.synchronize()
        barrier.wait()
        t0 = time.perf_counter()
        if ops:
            deadline = time.monotonic() + 300
            transport.wait(transport.issue(0, ops, deadline), deadline)
        torch.cuda.synchronize()
        barrier.wait()
        times.append(time.perf_counter() - t0)
    return {"seconds": times[1:]}


def raw_ceiling(links: dict[tuple[int, int], int], world: int, repeats: int) -> float:
    from refitplane.testing.nccl_world import run_nccl_world

    results = run_nccl_world(
        _ceiling_worker,
        world,
        channels=1,
        links={f"{s}>{d}": n for (s, d), n in links.items()},
        repeats=repeats,
    )
    for rank, (status, detail) in results.items():
        if status != "ok":
            raise RuntimeError(f"ceiling rank {rank}: {detail}")
    return float(max(statistics.median(detail["seconds"]) for _, detail in results.values()))


def per_dest_gbs(links: dict[tuple[int, int], int], seconds: float) -> float:
    per_dest: dict[int, int] = {}
    for (_, dst), n in links.items():
        per_dest[dst] = per_dest.get(dst, 0) + n
    return max(per_dest.values()) / seconds / 1e9


def measure_ceiling(
    out: dict[str, Any], links: dict[tuple[int, int], int], layout: GpuLayout, repeats: int
) -> None:
    """The ceiling of `links` on `layout`'s GPUs into `out` ("ceiling_s",
    "ceiling_gbs_per_dest"), and printed."""
    ceiling_s = raw_ceiling(links, layout.gpus, repeats)
    out["ceiling_s"] = ceiling_s
    out["ceiling_gbs_per_dest"] = per_dest_gbs(links, ceiling_s)
    print(
        f"  raw nccl4py ceiling: {ceiling_s:.3f} s, {out['ceiling_gbs_per_dest']:.1f} GB/s per destination GPU",
        flush=True,
    )
