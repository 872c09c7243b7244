"""Two-rank GPU cases shared by the GPU tests and `benchmarks/p2p_refit.py`.

Rank 0 (sender) holds `n` bf16 matrices, rank 1 (receiver) needs them:

- "whole": both hold/need every matrix whole (every message goes straight from parameter
  memory to parameter memory);
- "tp2": the sender holds each matrix as two column halves (separate tensors, like a TP2
  row-parallel weight), the receiver needs two row halves (like a TP2 column-parallel
  weight): every piece is a quarter, contiguous on the sender, strided on the receiver,
  so receives are staged and unpacked.

Contents are random bytes from a per-tensor seed, generated on the GPU, so the receiver
checks bit-exactness without any extra transfer.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.reshard.boxes import Box, box_shape, to_slices
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.planner import build_plan
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transport.base import P2POp, Transport

ROWS, COLS = 8192, 8192  # 128 MiB per bf16 matrix


@dataclass(frozen=True)
class P2PCase:
    name: str
    source: Layout
    target: Layout
    total_bytes: int


def make_case(name: str, gib: float) -> P2PCase:
    n = max(1, round(gib * 2**30 / (ROWS * COLS * 2)))
    src, dst = LayoutBuilder(), LayoutBuilder()
    for i in range(n):
        spec = TensorSpec.create(f"model.layers.{i}.mlp.weight", [ROWS, COLS], "bfloat16")
        if name == "whole":
            src.add(spec, 0, ((0, ROWS), (0, COLS)))
            dst.add(spec, 1, ((0, ROWS), (0, COLS)))
        elif name == "tp2":
            for half in range(2):
                src.add(spec, 0, ((0, ROWS), (half * COLS // 2, (half + 1) * COLS // 2)))
                dst.add(spec, 1, ((half * ROWS // 2, (half + 1) * ROWS // 2), (0, COLS)))
        else:
            raise ValueError(f"unknown case {name!r}")
    source, target = src.build(), dst.build()
    return P2PCase(name, source, target, target.total_bytes())


def _truth(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(spec.name.encode()).digest()[:6], "little")
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, device=device, generator=gen)
    return raw.view(torch.bfloat16).view(spec.shape)


def make_shards(layout: Layout, rank: int, device: torch.device, *, fill: bool) -> LocalShards:
    shards = LocalShards()
    for t in layout:
        full = _truth(t.spec, device) if fill else None
        for box in t.boxes.get(rank, ()):
            local = torch.empty(box_shape(box), dtype=torch.bfloat16, device=device)
            if full is not None:
                local.copy_(full[to_slices(box)])
            shards.add(t.spec, box, local)
        del full
    return shards


def mismatches(layout: Layout, rank: int, shards: LocalShards) -> list[str]:
    device = next(iter(shards)).tensor.device
    bad = []
    for t in layout:
        full = _truth(t.spec, device)
        for box in t.boxes.get(rank, ()):
            if not torch.equal(
                shards.view(t.spec.name, box).view(torch.uint8),
                full[to_slices(box)].view(torch.uint8),
            ):
                bad.append(f"{t.spec.name}{list(box)}")
        del full
    return bad


def rank_plan(case: P2PCase, rank: int) -> RankPlan:
    return build_plan(case.source, case.target).rank_plan(rank)


def refit_worker(
    *,
    rank: int,
    world: int,
    transport: Transport,
    barrier: Any,
    case_name: str,
    gib: float,
    bucket_mib: int = 256,
    ring_mib: int = 1024,
    refits: int = 1,
) -> dict[str, Any]:
    """A GPU test's rank (`nccl_world`): rank 0 sends case `case_name` to rank 1 `refits`
    times over `transport`; returns what the last refit moved and, on rank 1, the boxes that
    differ from the truth."""
    MiB = 1 << 20
    case = make_case(case_name, gib)
    layout = case.source if rank == 0 else case.target
    shards = make_shards(layout, rank, transport.device, fill=rank == 0)
    cfg = TransferConfig(
        bucket_bytes=bucket_mib * MiB,
        num_channels=2,
        max_inflight_bytes=ring_mib * MiB,
        timeout_s=120,
    )
    executor = Executor(transport, cfg)
    for _ in range(refits):
        report = executor.run(rank_plan(case, rank), shards)
    return {
        "bytes": report.bytes_received if rank == 1 else report.bytes_sent,
        "total": case.total_bytes,
        "verified": report.tensors_verified,
        "tensors": report.tensors_total,
        "peak": report.staging_peak_bytes,
        "mismatches": mismatches(layout, rank, shards) if rank == 1 else [],
    }


def timed_refit(
    transport: Transport,
    barrier: Any,
    plan: RankPlan,
    shards: LocalShards,
    config: TransferConfig,
    executor: Executor | None = None,
) -> tuple[float, Executor]:
    """One refit between barriers; returns seconds (this rank's view) and the executor."""
    ex = (
        executor
        if executor is not None and executor.config == config
        else Executor(transport, config)
    )
    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    ex.run(plan, shards)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    barrier.wait()
    return seconds, ex


def raw_p2p(
    transport: Transport, barrier: Any, rank: int, total_bytes: int, message_bytes: int
) -> float:
    """nccl4py send/recv of `total_bytes` in `message_bytes` messages, one group, channel 0."""
    device = transport.device
    buf = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    ops = [
        P2POp(rank == 0, 1 - rank, buf[off : off + message_bytes])
        for off in range(0, total_bytes, message_bytes)
    ]
    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    deadline = time.monotonic() + 120
    handle = transport.issue(0, ops, deadline)
    transport.wait(handle, deadline)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    barrier.wait()
    return seconds


def used_boxes(layout: Layout, rank: int) -> list[tuple[str, Box]]:
    return [(t.spec.name, b) for t in layout for b in t.boxes.get(rank, ())]
