"""Hypothesis strategies for shapes, meshes, placements and explicit boxes."""

from __future__ import annotations

from hypothesis import strategies as st

from refitplane.reshard.boxes import Box
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Placement, Replicate, Shard, placement_boxes

DTYPES = ["bfloat16", "float32", "float8_e4m3fn", "int64"]

shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def placements_for(draw: st.DrawFn, ndim: int, mesh_ndim: int) -> list[Placement]:
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    return [draw(st.sampled_from(choices)) for _ in range(mesh_ndim)]


@st.composite
def mesh_holdings(draw: st.DrawFn, shape: tuple[int, ...], first_rank: int) -> dict[int, list[Box]]:
    mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    size = 1
    for d in mesh_shape:
        size *= d
    ranks = draw(st.permutations(list(range(first_rank, first_rank + size))))
    mesh = DeviceMesh.create(mesh_shape, ranks)
    placements = draw(placements_for(len(shape), len(mesh_shape)))
    return {r: [b] for r, b in placement_boxes(shape, mesh, placements).items()}


@st.composite
def grid_holdings(
    draw: st.DrawFn, shape: tuple[int, ...], first_rank: int, replicas: int = 1
) -> dict[int, list[Box]]:
    """Explicit boxes: cut each dim at random points, give each cell to random rank(s)."""
    cuts = []
    for n in shape:
        points = (
            sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(3, n - 1)))) if n > 1 else []
        )
        bounds = [0, *points, n]
        cuts.append([(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)])
    cells: list[Box] = [()]
    for ranges in cuts:
        cells = [(*c, r) for c in cells for r in ranges]
    nranks = draw(st.integers(1, 4))
    out: dict[int, list[Box]] = {}
    for cell in cells:
        owners = draw(
            st.sets(st.integers(0, nranks - 1), min_size=1, max_size=min(replicas, nranks))
        )
        for o in owners:
            out.setdefault(first_rank + o, []).append(cell)
    return out


@st.composite
def holdings(draw: st.DrawFn, shape: tuple[int, ...], first_rank: int) -> dict[int, list[Box]]:
    if draw(st.booleans()):
        return draw(mesh_holdings(shape, first_rank))
    return draw(grid_holdings(shape, first_rank, replicas=draw(st.integers(1, 2))))


@st.composite
def layout_pair(draw: st.DrawFn, max_tensors: int = 3) -> tuple[LayoutBuilder, LayoutBuilder]:
    """A source (ranks 0..) and target (ranks 100..) layout over the same tensors."""
    src, dst = LayoutBuilder(), LayoutBuilder()
    for i in range(draw(st.integers(1, max_tensors))):
        shape = draw(shapes)
        spec = TensorSpec.create(f"t{i}", list(shape), draw(st.sampled_from(DTYPES)))
        src.add_spec(spec)
        dst.add_spec(spec)
        for rank, boxes in draw(holdings(shape, 0)).items():
            for b in boxes:
                src.add(spec, rank, b)
        for rank, boxes in draw(holdings(shape, 100)).items():
            for b in boxes:
                dst.add(spec, rank, b)
    return src, dst
