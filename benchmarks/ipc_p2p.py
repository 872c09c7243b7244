"""The plan of a model between two GPUs of one node without vLLM (`ipc_refit.py --case
cross-p2p`): CUDA IPC and NCCL P2P on the same plan in the same run, against the peer copy
limit; and the copy limits `ipc_refit.py` holds every case to (`copy_limit`: one device
copy of the plan's bytes, as the IPC receiver does)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from refitplane.testing.model_layouts import GPU_LAYOUTS

MiB = 1 << 20


def copy_limit(nbytes: int, src: int, dst: int, repeats: int = 5) -> float:
    """Seconds for the fastest device copy of `nbytes` from GPU `src` to GPU `dst` (one
    `copy_`, the copy engine), as the IPC receiver does."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
        best = min(best, time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return best


def plan_bytes(shape: str) -> int:
    from refitplane.reshard.planner import build_plan
    from refitplane.testing.model_layouts import model_layouts

    return build_plan(*model_layouts(shape, GPU_LAYOUTS["tp1"])).total_bytes


def _p2p_worker(
    *, rank: int, world: int, transport: Any, barrier: Any, shape: str, repeats: int, bucket: int
) -> dict[str, Any]:
    """One rank of `cross-p2p`: the model's TP1 plan (trainer rank 0 → vLLM rank 1) over the
    given transport, timed between barriers, checksums on, bytes compared at the end."""
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.planner import build_plan
    from refitplane.testing import p2p_cases as pc
    from refitplane.testing.model_layouts import model_layouts

    source, target = model_layouts(shape, GPU_LAYOUTS["tp1"])
    layout = source if rank == 0 else target
    shards = pc.make_shards(layout, rank, transport.device, fill=rank == 0)
    plan = build_plan(source, target).rank_plan(rank)
    config = TransferConfig(
        bucket_bytes=bucket * MiB, num_channels=2, max_inflight_bytes=4 * bucket * MiB
    )
    seconds, executor = pc.timed_refit(transport, barrier, plan, shards, config)
    times = []
    for _ in range(repeats):
        seconds, executor = pc.timed_refit(transport, barrier, plan, shards, config, executor)
        times.append(seconds)
    return {
        "seconds": times,
        "bytes": plan.recv_bytes if rank == 1 else plan.send_bytes,
        "mismatches": pc.mismatches(layout, rank, shards)[:5] if rank == 1 else [],
    }


def run_cross_p2p(args: argparse.Namespace) -> dict[str, Any]:
    """GPU 0 → GPU 1, the model's plan, no vLLM: CUDA IPC and NCCL P2P in the same run, with
    the peer copy limit."""
    from refitplane.testing.nccl_world import ranks_or_report, run_ipc_world, run_nccl_world

    nbytes = plan_bytes(args.model)
    limit_s = copy_limit(nbytes, 0, 1)
    out: dict[str, Any] = {"case": "cross-p2p", "model": args.model, "plan_bytes": nbytes}
    out["copy_limit_s"] = limit_s
    kwargs = {"shape": args.model, "repeats": args.repeats, "bucket": args.bucket}
    for name in ("ipc", "nccl"):
        if name == "ipc":
            results = run_ipc_world(_p2p_worker, [0, 1], timeout_s=120, **kwargs)
        else:
            results = run_nccl_world(_p2p_worker, 2, channels=2, timeout_s=120, **kwargs)
        ranks = ranks_or_report(results, 2)
        if ranks is None:
            out[name] = {"error": str(results)[:2000]}
            continue
        seconds = [max(a, b) for a, b in zip(ranks[0]["seconds"], ranks[1]["seconds"], strict=True)]
        best = min(seconds)
        out[name] = {
            "seconds": seconds,
            "gbs": nbytes / best / 1e9,
            "x_copy_limit": best / limit_s,
            "exact": not ranks[1]["mismatches"],
        }
        print(
            f"[cross-p2p] {args.model} GPU0->GPU1 {name}: best {best * 1e3:.1f} ms "
            f"({out[name]['gbs']:.0f} GB/s, {best / limit_s:.2f}x the peer copy limit "
            f"{limit_s * 1e3:.1f} ms), exact={out[name]['exact']}",
            flush=True,
        )
    return out
