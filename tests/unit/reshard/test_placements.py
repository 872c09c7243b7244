from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from refitplane.errors import LayoutError
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.placements import (
    DeviceMesh,
    Placement,
    Replicate,
    Shard,
    chunk_range,
    placement_boxes,
    placement_table,
)
from tests.unit.reshard.strategies import placements_for

pytestmark = pytest.mark.unit


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_matches_torch_dtensor(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=3)))
    mesh_shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    placements = data.draw(placements_for(len(shape), len(mesh_shape)))
    mesh = DeviceMesh.create(mesh_shape)
    ours = placement_boxes(shape, mesh, placements)
    torch_placements = [
        TorchShard(p.dim) if isinstance(p, Shard) else TorchReplicate() for p in placements
    ]
    for index, rank in enumerate(mesh.ranks):
        coord = list(mesh.coordinates(index))
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, coord, torch_placements
        )
        expected = tuple((o, o + n) for o, n in zip(offset, local, strict=True))
        if torch.Size(local).numel() == 0:
            assert rank not in ours
        else:
            assert ours[rank] == expected


def test_chunk_semantics_match_torch_chunk() -> None:
    for n in range(12):
        for k in range(1, 6):
            chunks = torch.arange(n).chunk(k)
            for i in range(k):
                a, b = chunk_range(n, k, i)
                got = list(range(a, b))
                want = chunks[i].tolist() if i < len(chunks) else []
                assert got == want, (n, k, i)


@pytest.mark.parametrize(
    ("shape", "ranks", "placements", "message"),
    [
        ([2, 2], [0, 1, 2], [Replicate(), Replicate()], "has 4 positions but 3 ranks"),
        ([2], [0, 0], [Replicate()], "more than once"),
        ([], None, [], "non-empty"),
        ([2], [0, 1], [Shard(3)], "Shard(3)"),
        ([2], [0, 1], [Replicate(), Replicate()], "2 placements for a 1-d mesh"),
    ],
)
def test_bad_meshes_are_named(
    shape: list[int], ranks: list[int] | None, placements: list[Shard | Replicate], message: str
) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        placement_boxes([4, 4], DeviceMesh.create(shape, ranks, tensor="w"), placements, tensor="w")


def test_placement_table_is_placement_boxes_by_rank_and_shared() -> None:
    mesh = DeviceMesh.create([2, 3], [9, 1, 7, 3, 5, 0])
    placements = [Shard(0), Shard(1)]
    table = placement_table((5, 7), mesh, placements)
    boxes = placement_boxes((5, 7), mesh, placements)
    assert list(table) == sorted(boxes)  # ranks in order, as a built layout keeps them
    assert table == {r: (b,) for r, b in boxes.items()}
    assert (
        placement_table([5, 7], DeviceMesh.create([2, 3], [9, 1, 7, 3, 5, 0]), placements) is table
    )
    assert list(boxes) == list(mesh.ranks)  # placement_boxes keeps mesh order


def test_equal_meshes_hash_alike_and_print_as_before() -> None:
    a, b = DeviceMesh.create([2, 2], [3, 2, 1, 0]), DeviceMesh.create([2, 2], [3, 2, 1, 0])
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != DeviceMesh.create([4], [3, 2, 1, 0])
    assert repr(a) == "DeviceMesh(shape=(2, 2), ranks=(3, 2, 1, 0))"


@st.composite
def _placed_twice(draw: st.DrawFn) -> tuple[TensorSpec, list[tuple[DeviceMesh, list[Placement]]]]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    spec = TensorSpec.create("w", list(shape), "bfloat16")
    out = []
    for _ in range(draw(st.integers(1, 3))):
        mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
        size = 1
        for d in mesh_shape:
            size *= d
        # Ranks drawn from a small pool: meshes of one tensor may share ranks (overlaps
        # are refused or allowed as per-box adds would be) or not (tables merge).
        ranks = draw(st.lists(st.integers(0, 11), min_size=size, max_size=size, unique=True))
        out.append(
            (
                DeviceMesh.create(mesh_shape, ranks),
                draw(placements_for(len(shape), len(mesh_shape))),
            )
        )
    return spec, out


def _outcome(build: Callable[[LayoutBuilder], None]) -> tuple[str, object]:
    builder = LayoutBuilder()
    try:
        build(builder)
        layout = builder.build()  # overlaps are found here
    except LayoutError as err:
        return "error", str(err)
    return layout.digest, dict(layout.tensors)


@settings(max_examples=300, deadline=None)
@given(_placed_twice(), st.booleans())
def test_add_placements_is_adding_each_box(
    case: tuple[TensorSpec, list[tuple[DeviceMesh, list[Placement]]]], box_first: bool
) -> None:
    """Same layout (and same error) as adding each box of `placement_boxes` in mesh order,
    with an explicit box added before or after."""
    spec, placed = case
    extra = tuple((0, 1) for _ in spec.shape)

    def by_table(b: LayoutBuilder) -> None:
        if box_first:
            b.add(spec, 6, extra)
        for mesh, placements in placed:
            b.add_placements(spec, mesh, placements)
        if not box_first:
            b.add(spec, 6, extra)

    def by_box(b: LayoutBuilder) -> None:
        if box_first:
            b.add(spec, 6, extra)
        for mesh, placements in placed:
            for rank, box in placement_boxes(spec.shape, mesh, placements).items():
                b.add(spec, rank, box)
        if not box_first:
            b.add(spec, 6, extra)

    assert _outcome(by_table) == _outcome(by_box)


def test_tensors_sharing_a_table_stay_apart() -> None:
    mesh = DeviceMesh.create([2], [0, 1])
    a, b = (TensorSpec.create(n, [4, 4], "float32") for n in ("a", "b"))
    builder = LayoutBuilder()
    builder.add_placements(a, mesh, [Shard(0)])
    builder.add_placements(b, mesh, [Shard(0)])
    first = builder.build()
    assert first.tensors["a"].boxes is first.tensors["b"].boxes  # one mapping for both
    builder.add(a, 5, ((0, 4), (0, 4)))  # the builder goes on: `a` gets its own copy
    second = builder.build()
    assert second.tensors["a"].boxes == {
        0: (((0, 2), (0, 4)),),
        1: (((2, 4), (0, 4)),),
        5: (((0, 4), (0, 4)),),
    }
    assert second.tensors["b"].boxes == first.tensors["b"].boxes == first.tensors["a"].boxes
    assert 5 not in placement_table((4, 4), mesh, [Shard(0)])


def test_a_refused_placement_leaves_the_tensor_declared() -> None:
    builder = LayoutBuilder()
    spec = TensorSpec.create("w", [4], "float32")
    with pytest.raises(LayoutError, match="Shard\\(1\\) on a 1-d tensor"):
        builder.add_placements(spec, DeviceMesh.create([2]), [Shard(1)])
    assert builder.build().tensors["w"].boxes == {}  # as after add_spec
