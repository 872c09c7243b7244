"""Staged receive in bounded memory (`StagedShards` + the executor's bucket boundaries).

Two ranks in one process (threads over a loopback transport): rank 0 holds a small model's
tensors whole, rank 1 stages what it needs — whole tensors of some, a row half of others
(the rest of those must be zero) — and applies them bucket by bucket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from refitplane.errors import ChecksumMismatch, InvalidArgument, LayoutError
from refitplane.reshard.boxes import Box, full_box, to_slices
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.staged import StagedBucket, StagedShards
from refitplane.reshard.stages import stage_of
from refitplane.reshard.staging import ring_bytes_for
from refitplane.reshard.transfer_report import TransferReport
from tests.unit.reshard.loopback import Corrupt, LoopbackHub, LoopbackTransport, pair_plans

pytestmark = pytest.mark.unit

LAYERS = 4
# Staging budget (max_inflight_bytes): ring and arena together; the largest bucket is 512.
BUDGET = 1024


def _specs() -> dict[str, TensorSpec]:
    specs = [TensorSpec.create("model.embed_tokens.weight", [32, 8], "bfloat16")]
    for i in range(LAYERS):
        specs += [
            TensorSpec.create(f"model.layers.{i}.self_attn.q_proj.weight", [16, 8], "bfloat16"),
            TensorSpec.create(f"model.layers.{i}.input_layernorm.weight", [8], "float32"),
        ]
    specs.append(TensorSpec.create("model.norm.weight", [8], "float32"))
    return {s.name: s for s in specs}


def _needed_box(spec: TensorSpec) -> Box:
    """Rank 1 needs the first half of each q_proj's rows (a TP shard), all of the rest."""
    if spec.name.endswith("q_proj.weight"):
        return ((0, spec.shape[0] // 2), (0, spec.shape[1]))
    return full_box(spec.shape)


def _column_box(spec: TensorSpec) -> Box:
    """The first half of each q_proj's columns (a row-parallel shard): strided in the
    whole-shape staged tensor, so those messages go through the staging ring."""
    if spec.name.endswith("q_proj.weight"):
        return ((0, spec.shape[0]), (0, spec.shape[1] // 2))
    return full_box(spec.shape)


def _value(spec: TensorSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, spec.name)))
    raw = torch.randint(1, 256, (spec.nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(torch_dtype(spec.dtype)).view(spec.shape)


def _plans(
    specs: Mapping[str, TensorSpec], needed: Callable[[TensorSpec], Box] = _needed_box
) -> tuple[RankPlan, RankPlan]:
    return pair_plans(specs, needed)


class Applied:
    """The owner's apply hook: checks the bucket's bytes are in place, records it."""

    def __init__(
        self,
        specs: Mapping[str, TensorSpec],
        fail_at: int = -1,
        needed: Callable[[TensorSpec], Box] = _needed_box,
    ) -> None:
        self.specs = specs
        self.fail_at = fail_at
        self.needed = needed
        self.buckets: list[StagedBucket] = []
        self.problems: list[str] = []
        self.values: dict[str, torch.Tensor] = {}
        self.staging_at_apply: list[int] = []
        self.shards: StagedShards | None = None
        # The receiving executor, and its staging ring's size (0: none held) at each apply.
        self.executor: Executor | None = None
        self.ring_at_apply: list[int] = []

    def __call__(self, bucket: StagedBucket, tensors: Mapping[str, torch.Tensor]) -> None:
        if bucket.index == self.fail_at:
            raise RuntimeError(f"reload of bucket {bucket.index} failed")
        self.buckets.append(bucket)
        assert self.shards is not None
        self.staging_at_apply.append(self.shards.staging_bytes)
        if self.executor is not None:
            ring = self.executor.ring
            self.ring_at_apply.append(ring.size if ring.allocated else 0)
        assert sorted(tensors) == sorted(bucket.names)
        for name, tensor in tensors.items():
            spec = self.specs[name]
            want = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype))
            box = self.needed(spec)
            want[to_slices(box)] = _value(spec)[to_slices(box)]
            if not torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)):
                self.problems.append(f"{name}: bytes at apply differ (bucket {bucket.index})")
            self.values[name] = tensor.clone()  # the staging itself is reused after this


def _run_pair(
    layerwise: bool = True,
    fail_at: int = -1,
    corrupt: Corrupt | None = None,
    config: TransferConfig | None = None,
    needed: Callable[[TensorSpec], Box] = _needed_box,
) -> dict[str, Any]:
    specs = _specs()
    send_plan, recv_plan = _plans(specs, needed)
    cfg = config or TransferConfig(bucket_bytes=64, max_inflight_bytes=BUDGET, num_channels=2)
    hub = LoopbackHub(corrupt)
    applied = Applied(specs, fail_at, needed)
    sender = LocalShards()
    for spec in specs.values():
        sender.add(spec, full_box(spec.shape), _value(spec))
    staged = StagedShards("cpu", applied, layerwise=layerwise)
    for spec in specs.values():
        staged.add_staged(spec, needed(spec))
    applied.shards = staged
    out: dict[str, Any] = {"applied": applied, "staged": staged}
    executors = [Executor(LoopbackTransport(hub, r, 2, cfg.num_channels), cfg) for r in (0, 1)]
    applied.executor = executors[1]

    def run(rank: int, plan: RankPlan, shards: LocalShards) -> None:
        executor = executors[rank]
        out[f"executor{rank}"] = executor
        try:
            out[f"report{rank}"] = executor.run(plan, shards)
        except Exception as exc:
            out[f"error{rank}"] = exc

    threads = [
        threading.Thread(target=run, args=(0, send_plan, sender)),
        threading.Thread(target=run, args=(1, recv_plan, staged)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_buckets_are_applied_once_each_in_stage_order_with_their_bytes_in_place() -> None:
    out = _run_pair()
    applied: Applied = out["applied"]
    staged: StagedShards = out["staged"]
    report: TransferReport = out["report1"]
    assert "error0" not in out, out
    assert "error1" not in out, out
    assert report.tensors_verified == report.tensors_total == len(_specs())
    # One bucket per stage here (the stages are about equal, each near the cap): all but
    # the last applied during the transfer, the last one held for the owner.
    assert report.staged_buckets == len(applied.buckets) + 1 == LAYERS + 2
    assert report.staged_applied == len(applied.buckets)
    held = staged.held
    assert held is not None
    staged.apply_held()
    assert staged.held is None
    assert applied.problems == []
    order = [stage for b in applied.buckets for stage in b.stages]
    assert order == sorted(order) == sorted({stage_of(n) for n in _specs()})
    assert [b.index for b in applied.buckets] == list(range(len(applied.buckets)))
    assert sorted(applied.values) == sorted(_specs())
    # The arena is the largest bucket, allocated once, and gone after the refit.
    largest = max(b.nbytes for b in applied.buckets)
    assert report.staged_peak_bytes == staged.staging_peak_bytes == largest
    assert set(applied.staging_at_apply) == {largest}
    assert staged.staging_bytes == 0
    assert staged.touched
    assert not out["executor1"].ring.allocated  # the ring is given back too


def test_whole_staging_is_one_bucket_applied_only_by_the_owner() -> None:
    out = _run_pair(layerwise=False)
    applied: Applied = out["applied"]
    staged: StagedShards = out["staged"]
    report: TransferReport = out["report1"]
    assert report.staged_buckets == 1
    assert report.staged_applied == 0
    assert applied.buckets == []
    assert not staged.touched
    staged.apply_held()
    assert [len(b.stages) for b in applied.buckets] == [LAYERS + 2]
    assert applied.problems == []
    assert staged.staging_bytes == 0


def test_a_second_refit_stages_afresh() -> None:
    specs = _specs()
    send_plan, recv_plan = _plans(specs)
    cfg = TransferConfig(bucket_bytes=64, max_inflight_bytes=BUDGET, num_channels=1)
    hub = LoopbackHub()
    sender = LocalShards()
    for spec in specs.values():
        sender.add(spec, full_box(spec.shape), _value(spec))
    applied = Applied(specs)
    staged = StagedShards("cpu", applied)
    for spec in specs.values():
        staged.add_staged(spec, _needed_box(spec))
    applied.shards = staged
    executors = [Executor(LoopbackTransport(hub, r, 2, 1), cfg) for r in (0, 1)]
    for _ in range(2):
        threads = [
            threading.Thread(target=executors[0].run, args=(send_plan, sender)),
            threading.Thread(target=executors[1].run, args=(recv_plan, staged)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        staged.apply_held()
    assert applied.problems == []
    assert len(applied.buckets) == 2 * (LAYERS + 2)


def test_an_exception_in_apply_aborts_the_transfer_with_weights_touched() -> None:
    out = _run_pair(fail_at=1)
    error = out["error1"]
    assert isinstance(error, RuntimeError)
    assert "bucket 1" in str(error)
    staged: StagedShards = out["staged"]
    assert staged.touched  # the failed apply may have changed weights
    assert out["executor1"].receives_posted
    assert 1 in out["executor1"].transport.hub.aborted
    assert staged.staging_bytes == 0
    assert staged.held is None
    assert [b.index for b in out["applied"].buckets] == [0]


def test_a_checksum_mismatch_after_applied_buckets_still_fails_and_says_touched() -> None:
    def flip_last(src: int, dst: int, channel: int, n: int, data: torch.Tensor) -> None:
        if channel == 0 and n == 3 and data.numel():
            data[0] ^= 0xFF

    out = _run_pair(corrupt=flip_last, config=TransferConfig(64, 1, BUDGET))
    assert isinstance(out["error1"], ChecksumMismatch), out
    staged: StagedShards = out["staged"]
    assert staged.touched
    assert len(out["applied"].buckets) > 0
    assert staged.staging_bytes == 0


def test_applying_during_the_transfer_needs_checksums() -> None:
    cfg = TransferConfig(
        bucket_bytes=64, max_inflight_bytes=BUDGET, num_channels=1, verify_checksums=False
    )
    specs = _specs()
    _, recv_plan = _plans(specs)
    staged = StagedShards("cpu", Applied(specs))
    for spec in specs.values():
        staged.add_staged(spec, _needed_box(spec))
    executor = Executor(LoopbackTransport(LoopbackHub(), 1, 2, 1), cfg)
    with pytest.raises(InvalidArgument, match="needs checksums"):
        executor.run(recv_plan, staged)
    assert executor.transport.issued == 0  # refused before any byte moved


def test_units_keep_stages_in_one_bucket_and_large_stages_alone() -> None:
    specs = {
        n: TensorSpec.create(n, shape, "float32")
        for n, shape in [
            ("model.layers.0.a", [64]),
            ("model.layers.1.a", [64]),
            ("model.layers.2.a", [64]),
            ("model.layers.3.a", [512]),
            ("model.norm.weight", [8]),
        ]
    }
    staged = StagedShards("cpu", Applied(specs), units=[{"model.layers.0.a", "model.layers.2.a"}])
    for spec in specs.values():
        staged.add_staged(spec, full_box(spec.shape))
    stages = [(stage_of(n), [n]) for n in sorted(specs, key=stage_of)]
    buckets = staged.plan(stages)
    # Layers 0..2 must load together (the unit spans them); layer 3 is the largest
    # (2048 bytes, the cap) and alone; the norm (256 aligned bytes) fits nowhere else.
    assert [[stage[1] for stage in b.stages] for b in buckets] == [[0, 1, 2], [3], [-1]]
    assert [b.nbytes for b in buckets] == [3 * 256, 2048, 256]
    with pytest.raises(LayoutError, match="receives nothing of it"):
        staged.plan(stages[:-1])


def test_a_staged_view_outside_its_bucket_is_an_error_naming_the_tensor() -> None:
    spec = TensorSpec.create("model.layers.0.a", [4], "float32")
    staged = StagedShards("cpu", Applied({spec.name: spec}))
    staged.add_staged(spec, full_box(spec.shape))
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.a"):
        staged.view(spec.name, full_box(spec.shape))


def test_a_receiver_whose_messages_land_in_its_arena_reserves_no_ring() -> None:
    """Row halves and whole tensors are one span of the bucket's arena each: every message
    goes direct, so no staging ring is reserved at all (before: `max_inflight_bytes` of it,
    beside the arena), and the rank's staging is the arena alone."""
    out = _run_pair()
    report: TransferReport = out["report1"]
    applied: Applied = out["applied"]
    assert "error1" not in out, out
    assert report.packed_messages == 0 < report.direct_messages
    assert report.ring_bytes == 0
    assert applied.ring_at_apply == [0] * len(applied.buckets)
    assert report.staging_peak_bytes == report.staged_peak_bytes == max(applied.staging_at_apply)
    # The sender holds every tensor whole: its messages go straight from them too.
    assert out["report0"].ring_bytes == 0
    assert not out["executor0"].ring.allocated


def test_a_receivers_ring_and_arena_stay_within_the_budget_together() -> None:
    """Column halves are strided in the arena: they are unpacked from the ring, which gets
    what the arena leaves of the budget, less than those messages take at once here."""
    out = _run_pair(needed=_column_box, config=TransferConfig(64, 2, BUDGET))
    report: TransferReport = out["report1"]
    applied: Applied = out["applied"]
    staged: StagedShards = out["staged"]
    assert "error0" not in out, out
    assert "error1" not in out, out
    assert applied.problems == []
    assert report.packed_messages > 0
    arena = report.staged_peak_bytes
    packed = ring_bytes_for([64] * report.packed_messages)
    assert packed > BUDGET - arena  # the budget, not the packed bytes, bounds the ring here
    assert report.ring_bytes == BUDGET - arena
    assert report.staging_peak_bytes == report.ring_bytes + arena <= BUDGET
    assert 0 < report.ring_peak_bytes <= report.ring_bytes
    # While each bucket was applied, ring and arena were both held, within the budget.
    assert all(
        ring + held <= BUDGET
        for ring, held in zip(applied.ring_at_apply, applied.staging_at_apply, strict=True)
    )
    assert set(applied.ring_at_apply) == {report.ring_bytes}
    staged.apply_held()
    assert applied.problems == []
    assert sorted(applied.values) == sorted(_specs())


def test_a_budget_that_cannot_hold_the_largest_bucket_is_refused_before_any_byte() -> None:
    specs = _specs()
    _, recv_plan = _plans(specs, _column_box)
    staged = StagedShards("cpu", Applied(specs, needed=_column_box))
    for spec in specs.values():
        staged.add_staged(spec, _column_box(spec))
    # The largest bucket is 512 bytes and the largest packed message 64: 576 needed.
    executor = Executor(
        LoopbackTransport(LoopbackHub(), 1, 2, 1), TransferConfig(64, 1, 512 + 64 - 1)
    )
    with pytest.raises(InvalidArgument, match=r"bucket \d+ \(.*512 bytes\).* at least 576 bytes"):
        executor.run(recv_plan, staged)
    assert executor.transport.issued == 0
    assert not executor.ring.allocated
