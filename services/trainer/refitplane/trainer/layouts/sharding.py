"""Which global indices of a sharded tensor one mesh coordinate holds, in local order.

DTensor shards a tensor dimension by one or more mesh dimensions, each a `torch.chunk`
split of what the previous one left. `_StridedShard(d, split_factor=k)` (what FSDP2 puts
on the data-parallel dimension of a tensor-parallel parameter) first cuts the dimension
into `k` pieces, chunks each piece, and concatenates the chunks of one coordinate, so a
rank's local rows need not be one contiguous global range. We therefore track, per
tensor dimension, the global indices held as *runs* (`(start, stop)` in local order);
a run of a dimension times a run of every other dimension is one box, backed by one
dense slice of the local tensor. Pure Python, so it can be checked against torch's own
`_split_tensor` / `compute_local_shape_and_global_offset` without a process group.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import Box
from refitplane.reshard.placements import chunk_range

Run = tuple[int, int]
Runs = tuple[Run, ...]


@dataclass(frozen=True, slots=True)
class MeshSplit:
    """One split of a tensor dimension by mesh dimension `mesh_dim`.

    `split_factor > 1` is torch's `_StridedShard`: the dimension is first cut into that
    many pieces, each piece is chunked over the mesh dimension, and a coordinate's
    chunks of all pieces are concatenated.
    """

    mesh_dim: int
    split_factor: int = 1


def _take(runs: Runs, start: int, stop: int) -> list[Run]:
    """Elements `[start, stop)` (positions in local order) of a run list."""
    out: list[Run] = []
    pos = 0
    for lo, hi in runs:
        n = hi - lo
        a, b = max(start, pos), min(stop, pos + n)
        if a < b:
            out.append((lo + a - pos, lo + b - pos))
        pos += n
        if pos >= stop:
            break
    return out


def _length(runs: Sequence[Run]) -> int:
    return sum(hi - lo for lo, hi in runs)


def _merge(runs: Sequence[Run]) -> Runs:
    out: list[Run] = []
    for lo, hi in runs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        elif hi > lo:
            out.append((lo, hi))
    return tuple(out)


def _chunk(runs: Runs, parts: int, index: int) -> list[Run]:
    start, stop = chunk_range(_length(runs), parts, index)
    return _take(runs, start, stop)


def split_runs(runs: Runs, split: MeshSplit, parts: int, index: int) -> Runs:
    """The runs coordinate `index` keeps when `runs` is split `parts` ways by `split`."""
    if split.split_factor == 1:
        return _merge(_chunk(runs, parts, index))
    kept: list[Run] = []
    for piece in range(split.split_factor):
        kept.extend(_chunk(tuple(_chunk(runs, split.split_factor, piece)), parts, index))
    return _merge(kept)


def local_runs(
    length: int,
    splits: Sequence[MeshSplit],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> Runs:
    """The global indices of one dimension that `coordinate` holds, as runs in local order."""
    runs: Runs = ((0, length),) if length else ()
    for split in splits:
        runs = split_runs(runs, split, mesh_shape[split.mesh_dim], coordinate[split.mesh_dim])
    return runs


def local_pieces(
    shape: Sequence[int],
    splits_by_dim: Mapping[int, Sequence[MeshSplit]],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    *,
    tensor: str | None = None,
) -> list[tuple[Box, Box]]:
    """`(global box, local box)` pairs covering what `coordinate` holds; empty if nothing.

    Each local box is a dense slice of the local tensor, so `local[to_slices(local_box)]`
    is a view with exactly the global box's shape.
    """
    if len(coordinate) != len(mesh_shape):
        raise LayoutError(
            f"mesh coordinate {list(coordinate)} does not fit mesh shape {list(mesh_shape)}",
            tensor=tensor,
            field="mesh",
        )
    for dim, splits in splits_by_dim.items():
        if not 0 <= dim < len(shape):
            raise LayoutError(f"shard on dim {dim} of a {len(shape)}-d tensor", tensor=tensor)
        for s in splits:
            if not 0 <= s.mesh_dim < len(mesh_shape) or s.split_factor < 1:
                raise LayoutError(f"invalid split {s} for mesh {list(mesh_shape)}", tensor=tensor)
    per_dim: list[list[tuple[Run, Run]]] = []
    for dim, length in enumerate(shape):
        runs = local_runs(length, splits_by_dim.get(dim, ()), mesh_shape, coordinate)
        if not runs:
            return []
        pairs: list[tuple[Run, Run]] = []
        offset = 0
        for lo, hi in runs:
            pairs.append(((lo, hi), (offset, offset + hi - lo)))
            offset += hi - lo
        per_dim.append(pairs)
    return [
        (tuple(g for g, _ in combo), tuple(lb for _, lb in combo))
        for combo in itertools.product(*per_dim)
    ]


def local_shape(pieces: Sequence[tuple[Box, Box]], ndim: int) -> tuple[int, ...]:
    """The local tensor shape the pieces imply (the far corner of the local boxes)."""
    if not pieces:
        return ()
    return tuple(max(local[d][1] for _, local in pieces) for d in range(ndim))
