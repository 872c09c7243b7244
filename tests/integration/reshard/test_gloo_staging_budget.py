"""A rank's staging (ring + staged arena) fits `max_inflight_bytes`, over real Gloo between
two real processes.

Rank 0 holds a small model's tensors whole; rank 1 stages whole-shape checkpoint tensors a
decoder layer at a time (`StagedShards`, as a vLLM worker whose kernels repack its weights)
and checks every bucket's bytes when it applies it. Every tensor is at least half a bucket,
so each message carries one chunk. Two refits in one group:

- "rows": rank 1 needs row halves of the projections: each message is one span of the
  bucket's arena (and of rank 0's tensors), so neither rank reserves a staging ring;
- "columns": column halves, strided on both ends: rank 0 packs them into a ring as large as
  those messages (less than the budget), rank 1 unpacks them from a ring as large as the
  arena leaves of the budget (less than the messages take).

While each bucket is applied, rank 1 records its ring and arena: together within the budget.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refitplane.reshard.boxes import Box, full_box, to_slices
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.planner import build_plan
from refitplane.reshard.schedule import rank_schedule
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.staged import StagedBucket, StagedShards
from refitplane.reshard.staging import ring_bytes_for
from refitplane.reshard.transport.gloo import GlooTransport
from tests.integration.reshard.gloo_world import run_world
from tests.integration.reshard.scenarios import global_tensor

pytestmark = pytest.mark.integration

LAYERS = 4
BUCKET = 1024
# A decoder layer stages 4096 + 2048 + 1024 = 7168 bytes (the arena); the column halves of
# the projections take 12 * 1024 bytes of ring at once.
BUDGET = 16 * 1024
CASES = ("rows", "columns")


def _specs() -> list[TensorSpec]:
    specs = [TensorSpec.create("model.embed_tokens.weight", [64, 32], "bfloat16")]
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        specs += [
            TensorSpec.create(f"{prefix}.self_attn.q_proj.weight", [64, 32], "bfloat16"),
            TensorSpec.create(f"{prefix}.self_attn.k_proj.weight", [32, 32], "bfloat16"),
            TensorSpec.create(f"{prefix}.input_layernorm.weight", [256], "float32"),
        ]
    return specs


def _needed(case: str, spec: TensorSpec) -> Box:
    if ".self_attn." not in spec.name:
        return full_box(spec.shape)
    rows, cols = spec.shape
    return ((0, rows // 2), (0, cols)) if case == "rows" else ((0, rows), (0, cols // 2))


def _layouts(case: str) -> tuple[Layout, Layout]:
    source, target = LayoutBuilder(), LayoutBuilder()
    for spec in _specs():
        source.add(spec, 0, full_box(spec.shape))
        target.add(spec, 1, _needed(case, spec))
    return source.build(), target.build()


def _expected(case: str, spec: TensorSpec) -> torch.Tensor:
    """The staged tensor at apply: the needed box from the checkpoint, zeros elsewhere."""
    want = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype))
    box = _needed(case, spec)
    want[to_slices(box)] = global_tensor(spec)[to_slices(box)]
    return want


def _receive(executor: Executor, case: str, plan: Any) -> dict[str, Any]:
    specs = {s.name: s for s in _specs()}
    at_apply: list[tuple[int, int]] = []
    wrong: list[str] = []
    staged: StagedShards

    def apply(bucket: StagedBucket, tensors: dict[str, torch.Tensor]) -> None:
        ring = executor.ring
        at_apply.append((ring.size if ring.allocated else 0, staged.staging_bytes))
        for name, tensor in tensors.items():
            if not torch.equal(
                tensor.view(torch.uint8), _expected(case, specs[name]).view(torch.uint8)
            ):
                wrong.append(name)

    staged = StagedShards("cpu", apply)
    for spec in specs.values():
        staged.add_staged(spec, _needed(case, spec))
    report = executor.run(plan, staged)
    staged.apply_held()
    return {
        "ring": report.ring_bytes,
        "ring_peak": report.ring_peak_bytes,
        "arena": report.staged_peak_bytes,
        "staging": report.staging_peak_bytes,
        "packed": report.packed_messages,
        "direct": report.direct_messages,
        "verified": (report.tensors_verified, report.tensors_total),
        "at_apply": at_apply,
        "applied": len(at_apply),
        "wrong": wrong,
    }


def _worker(*, rank: int, world: int, port: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = TransferConfig(
        bucket_bytes=BUCKET, max_inflight_bytes=BUDGET, num_channels=2, timeout_s=60
    )
    transport = GlooTransport(
        rank, world, f"127.0.0.1:{port}".encode(), num_channels=2, timeout_s=60
    )
    results: dict[str, Any] = {}
    for case in CASES:
        plan = build_plan(*_layouts(case)).rank_plan(rank)
        executor = Executor(transport, cfg)
        if rank == 1:
            results[case] = _receive(executor, case, plan)
            continue
        shards = LocalShards()
        for spec in _specs():
            shards.add(spec, full_box(spec.shape), global_tensor(spec).clone())
        report = executor.run(plan, shards)
        # The messages of strided boxes: what rank 0 must pack (each carries one chunk).
        strided = [
            m.nbytes
            for m in rank_schedule(plan, cfg).messages
            if case == "columns" and ".self_attn." in m.chunks[0].tensor
        ]
        results[case] = {
            "ring": report.ring_bytes,
            "allocated": executor.ring.allocated,
            "packed": report.packed_messages,
            "expected_ring": ring_bytes_for(strided),
            "strided": len(strided),
        }
    transport.close()
    return results


def test_staging_is_sized_to_the_plan_within_the_budget() -> None:
    results = run_world(_worker, 2)
    assert sorted(results) == [0, 1], results
    for rank, (status, detail) in results.items():
        assert status == "ok", (rank, detail)
    sender, receiver = results[0][1], results[1][1]

    rows = receiver["rows"]
    assert rows["wrong"] == [], rows
    assert rows["verified"][0] == rows["verified"][1] > 0
    assert rows["packed"] == 0 < rows["direct"]
    # Every message lands in the arena as it is: no ring, the arena is all the staging.
    assert rows["ring"] == 0
    assert rows["at_apply"] == [(0, rows["arena"])] * (LAYERS + 1)
    assert rows["staging"] == rows["arena"] == 7168
    assert sender["rows"]["ring"] == 0
    assert not sender["rows"]["allocated"]

    columns = receiver["columns"]
    assert columns["wrong"] == [], columns
    assert columns["verified"][0] == columns["verified"][1] > 0
    assert columns["packed"] == 3 * LAYERS
    # The ring gets what the arena leaves of the budget: less than its messages take.
    assert columns["ring"] == BUDGET - columns["arena"] < 3 * LAYERS * BUCKET
    assert columns["staging"] == columns["ring"] + columns["arena"] <= BUDGET
    assert 0 < columns["ring_peak"] <= columns["ring"]
    assert columns["applied"] == LAYERS + 1
    assert all(ring + arena <= BUDGET for ring, arena in columns["at_apply"])
    # The sender packs exactly its strided messages: its ring holds them all, no more.
    cols = sender["columns"]
    assert cols["packed"] == cols["strided"] == 3 * LAYERS
    assert cols["ring"] == cols["expected_ring"] < BUDGET
    assert cols["allocated"]
