from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from refitplane.errors import CoverageError, LayoutError
from refitplane.reshard.boxes import box_numel, contains
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Replicate, Shard, placement_boxes
from refitplane.reshard.plan import (
    plan_from_dict,
    plan_to_dict,
    rank_plan_from_dict,
    rank_plan_to_dict,
)
from refitplane.reshard.planner import build_plan
from tests.unit.reshard.strategies import layout_pair

pytestmark = pytest.mark.unit


def _covered_everywhere(source: Layout) -> bool:
    """Does the union of source holdings cover every element of every tensor?"""
    for t in source:
        mask = np.zeros(t.spec.shape, dtype=bool)
        for boxes in t.boxes.values():
            for b in boxes:
                mask[tuple(slice(a, c) for a, c in b)] = True
        if not mask.all():
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(layout_pair())
def test_every_needed_element_covered_exactly_once(
    pair: tuple[LayoutBuilder, LayoutBuilder],
) -> None:
    source, target = pair[0].build(), pair[1].build()
    if not _covered_everywhere(source):
        with pytest.raises(CoverageError):
            build_plan(source, target)
        return
    plan = build_plan(source, target)
    # Coverage: count, per destination rank and tensor, how often each element arrives.
    counts: dict[tuple[int, str], np.ndarray] = {}
    for link in plan.links:
        held = source.tensors
        for piece in link.pieces:
            # Each piece lies inside one box its sender holds.
            assert any(contains(b, piece.box) for b in held[piece.tensor].boxes[link.src])
            key = (link.dst, piece.tensor)
            arr = counts.setdefault(key, np.zeros(source.spec(piece.tensor).shape, dtype=np.int64))
            arr[tuple(slice(a, c) for a, c in piece.box)] += 1
    for t in target:
        for rank, boxes in t.boxes.items():
            want = np.zeros(t.spec.shape, dtype=np.int64)
            for b in boxes:
                want[tuple(slice(a, c) for a, c in b)] = 1
            got = counts.get((rank, t.spec.name), np.zeros(t.spec.shape, dtype=np.int64))
            assert np.array_equal(got, want), (t.spec.name, rank)
    # Bytes agree three ways.
    assert plan.total_bytes == target.total_bytes() == plan.stats().total_bytes
    for link in plan.links:
        assert link.nbytes == sum(
            box_numel(p.box) * plan.specs[p.tensor].itemsize for p in link.pieces
        )
    # Deterministic, serialisable, same digest.
    again = build_plan(source, target)
    assert again.links == plan.links
    assert again.digest == plan.digest
    assert plan_from_dict(plan_to_dict(plan)).links == plan.links
    for rank in {*source.ranks(), *target.ranks()}:
        rp = plan.rank_plan(rank)
        assert rank_plan_from_dict(rank_plan_to_dict(rp)) == rp


def _dp_tp_source(dp: int, tp: int) -> Layout:
    b = LayoutBuilder()
    mesh = DeviceMesh.create([dp, tp], list(range(dp * tp)))
    for i in range(8):
        spec = TensorSpec.create(f"layer.{i}.w", [64, 32], "bfloat16")
        for r, box in placement_boxes(spec.shape, mesh, [Replicate(), Shard(0)]).items():
            b.add(spec, r, box)
    return b.build()


def _tp_target(tp: int, first: int, replicas: int = 1) -> Layout:
    b = LayoutBuilder()
    for rep in range(replicas):
        mesh = DeviceMesh.create([tp], list(range(first + rep * tp, first + (rep + 1) * tp)))
        for i in range(8):
            spec = TensorSpec.create(f"layer.{i}.w", [64, 32], "bfloat16")
            for r, box in placement_boxes(spec.shape, mesh, [Shard(1)]).items():
                b.add(spec, r, box)
    return b.build()


def test_replicas_share_the_sending() -> None:
    plan = build_plan(_dp_tp_source(dp=4, tp=2), _tp_target(tp=4, first=100, replicas=2))
    stats = plan.stats()
    assert set(stats.send_bytes) == set(range(8))
    assert stats.send_imbalance < 1.05
    assert stats.recv_imbalance == 1.0


def test_same_host_senders_are_preferred() -> None:
    source, target = _dp_tp_source(dp=2, tp=2), _tp_target(tp=2, first=100)
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 100: "b", 101: "b"}
    plan = build_plan(source, target, hosts=hosts)
    assert {link.src for link in plan.links} == {2, 3}


def _one(
    name: str, shape: list[int], dtype: str, rank: int, box: tuple[tuple[int, int], ...]
) -> Layout:
    b = LayoutBuilder()
    b.add(TensorSpec.create(name, shape, dtype), rank, box)
    return b.build()


def test_uncovered_box_is_named() -> None:
    source = _one("w", [8, 4], "bfloat16", 0, ((0, 6), (0, 4)))
    target = _one("w", [8, 4], "bfloat16", 7, ((4, 8), (0, 4)))
    with pytest.raises(CoverageError) as err:
        build_plan(source, target)
    assert err.value.tensor == "w"
    assert err.value.rank == 7
    assert err.value.box == "[6:8, 0:4]"
    assert "'w', rank 7, box [6:8, 0:4]" in str(err.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            _one("w", [8, 5], "bfloat16", 9, ((0, 8), (0, 5))),
            r"source has shape \[8, 4\], destination expects \[8, 5\]",
        ),
        (
            _one("w", [8, 4], "float16", 9, ((0, 8), (0, 4))),
            "source has dtype bfloat16, destination expects float16",
        ),
        (_one("missing", [2], "float32", 9, ((0, 2),)), "no source rank holds it"),
    ],
)
def test_mismatches_are_named(target: Layout, message: str) -> None:
    source = _one("w", [8, 4], "bfloat16", 0, ((0, 8), (0, 4)))
    with pytest.raises(LayoutError, match=message):
        build_plan(source, target)


def test_ranks_on_both_sides_are_rejected() -> None:
    layout = _one("w", [8, 4], "bfloat16", 0, ((0, 8), (0, 4)))
    with pytest.raises(LayoutError, match="appear on both sides"):
        build_plan(layout, layout)


def test_builder_rejects_bad_boxes() -> None:
    spec = TensorSpec.create("w", [8, 4], "bfloat16")
    b = LayoutBuilder()
    b.add(spec, 0, ((0, 4), (0, 4)))
    with pytest.raises(LayoutError, match="overlaps box"):
        b.add(spec, 0, ((3, 8), (0, 4)))
    with pytest.raises(LayoutError, match="out of range"):
        b.add(spec, 1, ((0, 9), (0, 4)))
    with pytest.raises(LayoutError, match="out of range"):
        b.add(spec, 1, ((0, 4),))
    with pytest.raises(LayoutError, match="empty"):
        b.add(spec, 1, ((2, 2), (0, 4)))
    with pytest.raises(LayoutError, match="declared as shape"):
        b.add(TensorSpec.create("w", [8, 5], "bfloat16"), 2, ((0, 1), (0, 1)))
    with pytest.raises(LayoutError, match="dimension 0 is -1"):
        TensorSpec.create("w", [-1], "bfloat16")
    with pytest.raises(LayoutError, match="unknown dtype 'float128'"):
        TensorSpec.create("w", [1], "float128")


def test_source_tensor_no_destination_needs_is_a_model_mismatch() -> None:
    b = LayoutBuilder()
    b.add(TensorSpec.create("w", [8, 4], "bfloat16"), 0, ((0, 8), (0, 4)))
    b.add(TensorSpec.create("model.layers.2.mlp.up_proj.weight", [4], "bfloat16"), 1, ((0, 4),))
    target = _one("w", [8, 4], "bfloat16", 9, ((0, 8), (0, 4)))
    with pytest.raises(
        LayoutError,
        match=r"'model.layers.2.mlp.up_proj.weight', rank 1: held by the source but no destination needs it",
    ):
        build_plan(b.build(), target)
    assert build_plan(b.build(), target, allow_unused=True).total_bytes == 64
