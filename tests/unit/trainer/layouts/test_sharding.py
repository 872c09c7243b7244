"""Index runs of DTensor shards vs torch's own splitting, uneven and strided cases included."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import to_slices
from refitplane.trainer.layouts.dtensor import mesh_splits
from refitplane.trainer.layouts.sharding import MeshSplit, local_pieces, local_runs, local_shape

pytestmark = pytest.mark.unit


def torch_local(
    full: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...], placements: list[Placement]
) -> torch.Tensor:
    """What torch gives a coordinate: each placement's own split, applied left to right."""
    local = full
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard | _StridedShard):
            parts, _ = p._split_tensor(local, mesh[mesh_dim], with_padding=False)
            local = parts[coord[mesh_dim]]
    return local


def check(shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Placement]) -> None:
    full = (
        torch.arange(max(1, torch.Size(shape).numel())).reshape(shape)
        if all(shape)
        else (torch.zeros(shape, dtype=torch.int64))
    )
    splits = mesh_splits(placements)
    for coord in itertools.product(*(range(n) for n in mesh)):
        want = torch_local(full, mesh, coord, placements)
        pieces = local_pieces(shape, splits, mesh, coord)
        if want.numel() == 0:
            assert pieces == [], (coord, pieces)
            continue
        assert local_shape(pieces, len(shape)) == tuple(want.shape)
        assert (
            sum(torch.Size([hi - lo for lo, hi in lb]).numel() for _, lb in pieces) == want.numel()
        )
        for global_box, local_box in pieces:
            assert torch.equal(want[to_slices(local_box)], full[to_slices(global_box)])
        t_shape, t_offset = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), placements
        )
        assert tuple(t_shape) == tuple(want.shape)
        assert tuple(lo for lo, _ in pieces[0][0]) == tuple(t_offset)


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((8, 4), (4,), [Shard(0)]),
        ((5, 3), (4,), [Shard(0)]),  # uneven, last rank empty
        ((75, 64), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over TP
        ((101, 8), (2, 2), [Shard(0), Shard(1)]),
        ((9, 7), (2, 3), [Shard(1), Shard(1)]),  # nested shards of one dim
        ((6, 10), (2, 2), [Replicate(), Shard(1)]),
        ((3,), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # more ranks than rows
        ((), (2,), [Replicate()]),
    ],
)
def test_matches_torch_on_known_cases(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Placement]
) -> None:
    check(shape, mesh, placements)


@st.composite
def sharded(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[Placement]]:
    shape = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements: list[Placement] = []
    for _ in mesh:
        kind = draw(st.sampled_from(["r", "s", "ss"]))
        dim = draw(st.integers(0, len(shape) - 1))
        if kind == "r":
            placements.append(Replicate())
        elif kind == "s":
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=draw(st.integers(2, 3))))
    return shape, mesh, placements


@settings(max_examples=150, deadline=None)
@given(sharded())
def test_matches_torch_on_random_meshes(
    case: tuple[tuple[int, ...], tuple[int, ...], list[Placement]],
) -> None:
    check(*case)


def test_runs_keep_local_order_for_strided_shards() -> None:
    # 8 rows cut in 2 pieces, each chunked over 2: coordinate 0 holds rows 0-1 then 4-5.
    assert local_runs(8, [MeshSplit(0, split_factor=2)], (2,), (0,)) == ((0, 2), (4, 6))
    pieces = local_pieces((8, 3), {0: [MeshSplit(0, split_factor=2)]}, (2,), (1,))
    assert pieces == [(((2, 4), (0, 3)), ((0, 2), (0, 3))), (((6, 8), (0, 3)), ((2, 4), (0, 3)))]


def test_partial_placements_are_not_weights() -> None:
    with pytest.raises(LayoutError, match="neither Shard nor Replicate") as err:
        mesh_splits([Partial()], tensor="w")
    assert err.value.tensor == "w"


def test_explicit_shard_order_wins_over_left_to_right() -> None:
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    splits = mesh_splits([Shard(0), Shard(0)], order)
    assert splits == {0: [MeshSplit(1), MeshSplit(0)]}
    with pytest.raises(LayoutError, match="does not match"):
        mesh_splits([Shard(0), Replicate()], order)


def test_bad_coordinates_and_dims_name_the_tensor() -> None:
    with pytest.raises(LayoutError, match="does not fit"):
        local_pieces((4,), {}, (2, 2), (0,), tensor="t")
    with pytest.raises(LayoutError, match="dim 3"):
        local_pieces((4,), {3: [MeshSplit(0)]}, (2,), (0,), tensor="t")
