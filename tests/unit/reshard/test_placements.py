from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from refitplane.errors import LayoutError
from refitplane.reshard.placements import DeviceMesh, Replicate, Shard, chunk_range, placement_boxes
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
