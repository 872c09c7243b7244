"""DTensor-style descriptions (device mesh + one placement per mesh dimension) → boxes.

Matches `torch.distributed.tensor` semantics: mesh ranks are laid out row-major over the
mesh shape; placements apply in mesh-dimension order, so two `Shard(d)` on the same tensor
dimension nest (the second splits the first's chunk); every split follows `torch.chunk`
(chunk size `ceil(n / k)`, trailing chunks smaller or empty). Ranks whose chunk is empty
hold nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import Box


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int


@dataclass(frozen=True, slots=True)
class Replicate:
    pass


Placement = Shard | Replicate


@dataclass(frozen=True, slots=True)
class DeviceMesh:
    """A mesh: its shape and the global ranks in row-major order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    # A mesh keys the placement-table cache once per tensor placed (~10^5 times for the
    # largest models): hashed once here, not per lookup.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.shape, self.ranks)))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def create(
        shape: Sequence[int], ranks: Sequence[int] | None = None, *, tensor: str | None = None
    ) -> DeviceMesh:
        dims = tuple(int(d) for d in shape)
        if not dims or any(d <= 0 for d in dims):
            raise LayoutError(
                f"mesh shape {list(shape)} must be non-empty and positive",
                tensor=tensor,
                field="mesh.shape",
            )
        size = 1
        for d in dims:
            size *= d
        rank_list = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
        if len(rank_list) != size:
            raise LayoutError(
                f"mesh shape {list(dims)} has {size} positions but {len(rank_list)} ranks are listed",
                tensor=tensor,
                field="mesh.ranks",
            )
        if len(set(rank_list)) != len(rank_list):
            dup = sorted({r for r in rank_list if rank_list.count(r) > 1})
            raise LayoutError(
                f"mesh lists rank(s) {dup} more than once", tensor=tensor, field="mesh.ranks"
            )
        if any(r < 0 for r in rank_list):
            raise LayoutError("mesh ranks must be non-negative", tensor=tensor, field="mesh.ranks")
        return DeviceMesh(dims, rank_list)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def coordinates(self, index: int) -> tuple[int, ...]:
        coords = []
        for d in reversed(self.shape):
            coords.append(index % d)
            index //= d
        return tuple(reversed(coords))


def chunk_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """`torch.chunk` semantics: the `[start, stop)` of chunk `index` of `parts`."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def placement_boxes(
    shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    tensor: str | None = None,
) -> dict[int, Box]:
    """The box each mesh rank holds (in mesh order); ranks with an empty chunk are left out."""
    return dict(_table(tuple(shape), mesh, tuple(placements), tensor)[0])


def placement_table(
    shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    tensor: str | None = None,
) -> Mapping[int, tuple[Box, ...]]:
    """The same boxes as `placement_boxes`, in the form a `TensorLayout` keeps them (rank →
    boxes, ranks in order). Shared by every call with the same arguments: never modify it."""
    # A hit looked up here (a spec's shape is a tuple): one call less per tensor placed.
    hit = _TABLES.get((shape, mesh, tuple(placements))) if shape.__class__ is tuple else None
    if hit is None:
        hit = _table(tuple(shape), mesh, tuple(placements), tensor)
    return hit[1]


# (shape, mesh, placements) → (rank, box) pairs in mesh order, and the rank → boxes table.
# A model repeats a few shapes over its layers and experts on the same meshes, so the
# ~10^5 tensors of the largest ones have a few hundred distinct entries; a bounded dict
# (oldest entry dropped first) keeps a process that sees many models from growing.
_Entry = tuple[tuple[tuple[int, Box], ...], Mapping[int, tuple[Box, ...]]]
_TABLES: dict[tuple[tuple[int, ...], DeviceMesh, tuple[Placement, ...]], _Entry] = {}
_MAX_TABLES = 4096


def _table(
    shape: tuple[int, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    tensor: str | None,
) -> _Entry:
    key = (shape, mesh, placements)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit  # validity depends on the key alone: an entry was checked when made
    if len(placements) != len(mesh.shape):
        raise LayoutError(
            f"{len(placements)} placements for a {len(mesh.shape)}-d mesh",
            tensor=tensor,
            field="placements",
        )
    for p in placements:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            raise LayoutError(
                f"Shard({p.dim}) on a {len(shape)}-d tensor", tensor=tensor, field="placements"
            )
    pairs = _placement_boxes(shape, mesh, placements)
    entry: _Entry = (pairs, {rank: (box,) for rank, box in sorted(pairs)})
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES)), None)
    _TABLES[key] = entry
    return entry


def _placement_boxes(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[tuple[int, Box], ...]:
    out: list[tuple[int, Box]] = []
    for index, rank in enumerate(mesh.ranks):
        coords = mesh.coordinates(index)
        ranges = [(0, int(n)) for n in shape]
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                lo, hi = ranges[p.dim]
                c0, c1 = chunk_range(hi - lo, mesh.shape[mesh_dim], coords[mesh_dim])
                ranges[p.dim] = (lo + c0, lo + c1)
        if all(hi > lo for lo, hi in ranges):
            out.append((rank, tuple(ranges)))
    return tuple(out)
