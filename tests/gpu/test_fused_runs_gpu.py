"""MoE-shaped refit over NCCL between two GPUs: the sender holds every expert projection on
its own (a trainer), the receiver fuses them like vLLM (`w13` [E, 2I, H], `w2` [E, H, I]).
Run messages land straight in the fused parameters (no staging on the receiver), the
sender packs each with one kernel launch, and every byte arrives exactly, verified. Also:
the pack/unpack kernel on CUDA equals plain copies."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu(count=2)]

MiB = 1 << 20
LAYERS, EXPERTS, HIDDEN, INTER = 3, 32, 2048, 768  # 3 MiB per projection, like Qwen3-30B-A3B
PROJS = (
    ("gate_proj", (INTER, HIDDEN)),
    ("up_proj", (INTER, HIDDEN)),
    ("down_proj", (HIDDEN, INTER)),
)


def _names() -> list[tuple[str, tuple[int, int]]]:
    return [
        (f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", shape)
        for layer in range(LAYERS)
        for e in range(EXPERTS)
        for proj, shape in PROJS
    ] + [(f"model.layers.{layer}.input_layernorm.weight", (HIDDEN,)) for layer in range(LAYERS)]


def _value(name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")
    gen = torch.Generator(device=device).manual_seed(seed)
    n = 2 * int(torch.Size(shape).numel())
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
    return raw.view(torch.bfloat16).view(shape)


def _worker(*, rank: int, world: int, transport: Any, barrier: Any) -> dict[str, Any]:
    from refitplane.reshard.boxes import full_box
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor
    from refitplane.reshard.layout import LayoutBuilder, TensorSpec
    from refitplane.reshard.planner import build_plan
    from refitplane.reshard.shards import LocalShards

    device = transport.device
    specs = {n: TensorSpec.create(n, list(s), "bfloat16") for n, s in _names()}
    source, target = LayoutBuilder(), LayoutBuilder()
    for spec in specs.values():
        source.add(spec, 0, full_box(spec.shape))
        target.add(spec, 1, full_box(spec.shape))
    plan = build_plan(source.build(), target.build()).rank_plan(rank)
    shards = LocalShards()
    if rank == 0:
        for name, shape in _names():
            shards.add(specs[name], full_box(shape), _value(name, shape, device))
    else:
        for layer in range(LAYERS):
            w13 = torch.full((EXPERTS, 2 * INTER, HIDDEN), 7.0, dtype=torch.bfloat16, device=device)
            w2 = torch.full((EXPERTS, HIDDEN, INTER), 7.0, dtype=torch.bfloat16, device=device)
            for e in range(EXPERTS):
                p = f"model.layers.{layer}.mlp.experts.{e}"
                shards.add(
                    specs[f"{p}.gate_proj.weight"], full_box((INTER, HIDDEN)), w13[e, :INTER]
                )
                shards.add(specs[f"{p}.up_proj.weight"], full_box((INTER, HIDDEN)), w13[e, INTER:])
                shards.add(specs[f"{p}.down_proj.weight"], full_box((HIDDEN, INTER)), w2[e])
            norm = f"model.layers.{layer}.input_layernorm.weight"
            shards.add(
                specs[norm],
                full_box((HIDDEN,)),
                torch.zeros(HIDDEN, dtype=torch.bfloat16, device=device),
            )
    cfg = TransferConfig(
        bucket_bytes=64 * MiB, num_channels=2, max_inflight_bytes=256 * MiB, timeout_s=40
    )
    executor = Executor(transport, cfg)
    reports = [executor.run(plan, shards) for _ in range(2)]  # the second reuses the tables
    out: dict[str, Any] = {
        "verified": [r.tensors_verified for r in reports],
        "tensors": reports[0].tensors_total,
        "packed": reports[-1].packed_messages,
        "direct": reports[-1].direct_messages,
        "peak": reports[-1].staging_peak_bytes,
    }
    if rank == 1:
        out["mismatches"] = [
            name
            for name, shape in _names()
            if not torch.equal(
                shards.view(name, full_box(shape)).view(torch.uint8),
                _value(name, shape, device).view(torch.uint8),
            )
        ]
    return out


def test_moe_runs_land_in_fused_parameters_exactly() -> None:
    from refitplane.testing.nccl_world import run_nccl_world

    results = run_nccl_world(_worker, 2, channels=2, timeout_s=60)
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", detail
    recv = results[1][1]
    assert recv["mismatches"] == []
    assert recv["verified"] == [recv["tensors"]] * 2
    # Every message went straight into the receiver's memory (the layer norms alone).
    assert recv["packed"] == 0
    assert recv["peak"] == 0
    # The sender holds every projection on its own: its run messages are packed (one
    # kernel launch each).
    assert results[0][1]["packed"] > 2 * LAYERS


def test_copy_kernel_equals_plain_copies_on_cuda() -> None:
    from refitplane.reshard import chunk_copy as cc

    gen = torch.Generator(device="cuda").manual_seed(3)
    sizes = [8, 13, 0, 1, cc._BYTES_PER_PROGRAM + 5, 3 * MiB, 24, 7 * MiB + 3]
    arena = torch.randint(
        0, 256, (sum(sizes) + 8 * len(sizes),), dtype=torch.uint8, device="cuda", generator=gen
    )
    sources, at = [], 0
    for n in sizes:
        sources.append(arena[at : at + n])
        at = (at + n + 7) // 8 * 8
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = (end + n + 15) // 16 * 16
    ring = torch.full((end + 256,), 0xA5, dtype=torch.uint8, device="cuda")
    buf = ring[256:]
    (table,) = cc.build_tables([(sources, offsets)], torch.device("cuda"))
    cc.launch(table, buf, scatter=False)
    for src, off in zip(sources, offsets, strict=True):
        assert torch.equal(buf[off : off + src.numel()], src)
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    (back,) = cc.build_tables([(targets, offsets)], torch.device("cuda"))
    cc.launch(back, buf, scatter=True)
    torch.cuda.synchronize()
    for src, dst in zip(sources, targets, strict=True):
        assert torch.equal(src, dst)
