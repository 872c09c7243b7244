"""Layouts: for every canonical tensor, its spec and the boxes each rank holds or needs.

Canonical names are Hugging Face checkpoint names. The same type describes both sides:
on the source (trainer) side a rank's boxes are what it *holds*, on the destination
(generator) side what it *needs*. Ranks on the two sides live in separate namespaces
until the coordinator maps them onto group ranks.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import (
    Box,
    box_numel,
    first_overlap,
    format_box,
    is_empty,
    within_shape,
)
from refitplane.reshard.dtypes import ITEMSIZE, canonical_dtype, itemsize
from refitplane.reshard.placements import DeviceMesh, Placement, placement_table

# Limits that keep a malformed layout from exhausting memory in the planner.
MAX_DIMS = 8
MAX_DIM_SIZE = 1 << 40


@contextmanager
def gc_paused() -> Iterator[None]:
    """Building layouts and plans allocates ~10^5-10^6 small objects and no cycles;
    generational GC passes over them would cost a good part of the building itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# Shapes made by `TensorSpec.create`, each once (bounded: a new model's shapes refill it).
_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
_MAX_SHAPES = 1 << 16


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @staticmethod
    def create(name: str, shape: Sequence[int], dtype: str) -> TensorSpec:
        """Validated constructor: a clear error for every malformed field."""
        # Fast path (the largest models have ~10^5 tensors): a valid name, int dimensions in
        # range, a canonical dtype name. Equal shapes share one tuple, so work keyed by a
        # shape object (the layout digest's text) is done once per distinct shape.
        if name.__class__ is str and name and len(shape) <= MAX_DIMS:
            given = tuple(shape)
            for d in given:
                if d.__class__ is not int or not 0 <= d <= MAX_DIM_SIZE:
                    break
            else:
                if dtype.__class__ is str and dtype in ITEMSIZE:
                    known = _SHAPES.get(given)
                    if known is None:
                        if len(_SHAPES) >= _MAX_SHAPES:
                            _SHAPES.clear()
                        known = _SHAPES[given] = given
                    return TensorSpec(name, known, dtype)
        if not isinstance(name, str) or not name:
            raise LayoutError("tensor name must be a non-empty string", field="name")
        if len(shape) > MAX_DIMS:
            raise LayoutError(
                f"{len(shape)} dimensions (max {MAX_DIMS})", tensor=name, field="shape"
            )
        dims = []
        for i, d in enumerate(shape):
            if isinstance(d, bool) or not isinstance(d, int):
                raise LayoutError(
                    f"dimension {i} is {d!r}, not an integer", tensor=name, field="shape"
                )
            if d < 0 or d > MAX_DIM_SIZE:
                raise LayoutError(
                    f"dimension {i} is {d} (must be 0..{MAX_DIM_SIZE})", tensor=name, field="shape"
                )
            dims.append(d)
        return TensorSpec(name, tuple(dims), canonical_dtype(dtype, tensor=name))


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One tensor's spec and, per rank, the (non-empty, non-overlapping) boxes it has."""

    spec: TensorSpec
    boxes: Mapping[int, tuple[Box, ...]]

    def ranks(self) -> list[int]:
        return sorted(self.boxes)


@dataclass(frozen=True)
class Layout:
    """All tensors of one side, by canonical name (iteration is in sorted name order).

    Tensors placed the same way may share one `boxes` mapping object (a builder hands out
    one per distinct placement or content): mappings are read-only, and work per distinct
    mapping (digest text, planner geometry) is done once per object.
    """

    tensors: Mapping[str, TensorLayout]
    # Derived once, on first use: the digest, the sorted names, the ranks.
    _memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __iter__(self) -> Iterator[TensorLayout]:
        tensors = self.tensors
        for name in self.names():
            yield tensors[name]

    def __len__(self) -> int:
        return len(self.tensors)

    def names(self) -> tuple[str, ...]:
        """Tensor names in sorted order (the order of iteration and of the digest)."""
        names: tuple[str, ...] | None = self._memo.get("names")
        if names is None:
            names = self._memo["names"] = tuple(sorted(self.tensors))
        return names

    def ranks(self) -> list[int]:
        ranks: list[int] | None = self._memo.get("ranks")
        if ranks is None:
            out: set[int] = set()
            for boxes in {id(t.boxes): t.boxes for t in self.tensors.values()}.values():
                out.update(boxes)  # once per distinct mapping object
            ranks = self._memo["ranks"] = sorted(out)
        return list(ranks)

    def spec(self, name: str) -> TensorSpec:
        return self.tensors[name].spec

    def for_rank(self, rank: int) -> Layout:
        """The part of this layout one rank holds or needs."""
        builder = LayoutBuilder()
        for t in self:
            for box in t.boxes.get(rank, ()):
                builder.add(t.spec, rank, box)
        return builder.build()

    def relabel(self, mapping: Mapping[int, int]) -> Layout:
        """The same layout with ranks renamed (e.g. local rank → group rank)."""
        # One renamed mapping per distinct mapping object, shared as the original was.
        renamed: dict[int, tuple[Mapping[int, tuple[Box, ...]], dict[int, tuple[Box, ...]]]] = {}
        tensors = {}
        for name, t in self.tensors.items():
            boxes = t.boxes
            hit = renamed.get(id(boxes))
            if hit is None:
                hit = renamed[id(boxes)] = (boxes, {mapping[r]: b for r, b in boxes.items()})
            tensors[name] = TensorLayout(t.spec, hit[1])
        return Layout(tensors)

    def total_bytes(self) -> int:
        """Bytes of all boxes of all ranks (what a destination side must receive)."""
        total = 0
        for t in self.tensors.values():
            size = t.spec.itemsize
            for boxes in t.boxes.values():
                total += sum(box_numel(b) for b in boxes) * size
        return total

    @property
    def digest(self) -> str:
        """A stable hash of the layout's content (names, specs, ranks, boxes)."""
        digest: str | None = self._memo.get("digest")
        if digest is None:
            digest = self._memo["digest"] = _digest(self)
        return digest


def _digest(layout: Layout) -> str:
    """sha256 over, per tensor in name order, `name|shape|dtype`, then `|rank:[boxes]` per
    rank in order (boxes sorted), then a newline. Fed in large chunks (the same bytes as
    one update per field). All but the name is made once per (shape object, dtype, boxes
    object) — a model repeats a few shapes and mappings over its layers and experts — and
    each mapping's text once per distinct content for mappings that are not shared."""
    h = hashlib.sha256()
    # Keyed by ids of objects `layout` keeps alive while this runs.
    tails: dict[tuple[int, str, int], str] = {}
    by_content: dict[tuple[tuple[int, tuple[Box, ...]], ...], str] = {}
    parts: list[str] = []
    tensors = layout.tensors
    for name in layout.names():
        t = tensors[name]
        s = t.spec
        key = (id(s.shape), s.dtype, id(t.boxes))
        tail = tails.get(key)
        if tail is None:
            tail = tails[key] = f"|{s.shape}|{s.dtype}{_mapping_text(t.boxes, by_content)}\n"
        parts += (s.name, tail)
        if len(parts) >= 2 * 4096:
            h.update("".join(parts).encode())
            parts.clear()
    h.update("".join(parts).encode())
    return h.hexdigest()


def _mapping_text(
    boxes: Mapping[int, tuple[Box, ...]],
    by_content: dict[tuple[tuple[int, tuple[Box, ...]], ...], str],
) -> str:
    items = tuple(boxes.items())
    try:
        text = by_content.get(items)
    except TypeError:  # a box given as lists: unhashable, and never shared
        text, items = None, ()
    if text is None:
        text = "".join(f"|{rank}:{sorted(boxes[rank])}" for rank in sorted(boxes))
        if items:
            by_content[items] = text
    return text


_Table = Mapping[int, tuple[Box, ...]]


class LayoutBuilder:
    """Accumulates (spec, rank, box) entries from any number of ranks and validates them.

    Errors name the tensor, rank and box: specs that disagree between ranks, boxes out of
    range or of the wrong rank, empty boxes (at `add`), a rank listing the same element twice
    (at `build`: one sort-and-sweep per tensor and rank, O(n log n), where checking each
    box against those before it cost O(n^2)).
    """

    def __init__(self) -> None:
        self._specs: dict[str, TensorSpec] = {}
        # Per tensor, per rank, the boxes in the order added (sorted by `build`)
        self._boxes: dict[str, dict[int, tuple[Box, ...]]] = {}
        # Tensors with a rank listing more than one box (only those need their boxes sorted
        # and checked for overlaps); their boxes per rank, in the order added
        self._several: set[str] = set()
        self._more: dict[tuple[str, int], list[Box]] = {}
        # Tensors whose boxes are exactly one placement's (shared, valid by construction);
        # a tensor is here or in `_boxes`, never both, and moves to `_boxes` (a copy) when
        # more boxes are added to it.
        self._tables: dict[str, Mapping[int, tuple[Box, ...]]] = {}
        # Unions of two tables, by the tables' ids (see `_union`)
        self._unions: dict[tuple[int, int], tuple[_Table, _Table, _Table | None]] = {}

    def add_spec(self, spec: TensorSpec) -> None:
        known = self._specs.get(spec.name)
        if known is None:
            self._specs[spec.name] = spec
            self._boxes[spec.name] = {}
        elif known != spec:
            raise LayoutError(
                f"declared as shape {list(spec.shape)} {spec.dtype} but elsewhere as "
                f"shape {list(known.shape)} {known.dtype}",
                tensor=spec.name,
                field="shape" if known.shape != spec.shape else "dtype",
            )

    def add(self, spec: TensorSpec, rank: int, box: Box) -> None:
        # Fast path first (layouts of the largest models add ~10^6 boxes): the spec object
        # already known, an int rank, a box inside the shape, nothing else on that rank yet.
        if self._specs.get(spec.name) is not spec:
            self.add_spec(spec)  # registers it, or checks it against the one known
        if rank.__class__ is int and rank >= 0:
            shape = spec.shape
            if len(box) == len(shape):
                for (start, stop), n in zip(box, shape):  # noqa: B905 (lengths checked)
                    if not 0 <= start < stop <= n:
                        break
                else:
                    per_rank_boxes = self._boxes.get(spec.name)
                    if per_rank_boxes is not None and rank not in per_rank_boxes:
                        per_rank_boxes[rank] = (box,)
                        return
        self._add_checked(spec, rank, box)

    def add_placements(
        self, spec: TensorSpec, mesh: DeviceMesh, placements: Sequence[Placement]
    ) -> None:
        """Add the boxes a DTensor-style placement gives each mesh rank (`placement_boxes`).

        The common case — a tensor placed once — costs one lookup whatever the number of
        ranks: the placement's box table is computed once per (shape, mesh, placements)
        and shared by every tensor placed that way.
        """
        name = spec.name
        known = self._specs.get(name)
        if known is None:
            # A new tensor (as `add_spec` would register it, with no boxes should the
            # placement be refused), then its table.
            self._specs[name] = spec
            self._tables[name] = {}
            self._tables[name] = placement_table(spec.shape, mesh, placements, tensor=name)
            return
        if known is not spec:
            self.add_spec(spec)
        table = placement_table(spec.shape, mesh, placements, tensor=name)
        boxes = self._boxes.get(name)
        if boxes is not None and not boxes:
            del self._boxes[name]
            self._tables[name] = table
            return
        current = self._tables.get(name)
        if current is not None:
            # Placed before on other ranks (e.g. one mesh per generator replica): the union
            # of two valid tables on disjoint ranks is valid, and made once per pair.
            union = self._union(current, table)
            if union is not None:
                self._tables[name] = union
                return
        # The tensor has boxes already: each new one is checked against them, in mesh order.
        for rank in mesh.ranks:
            held = table.get(rank)
            if held is not None:
                self.add(spec, rank, held[0])

    def _union(self, a: _Table, b: _Table) -> _Table | None:
        """`a` and `b` as one table (ranks in order) if no rank is in both, else None."""
        key = (id(a), id(b))
        hit = self._unions.get(key)
        if hit is None:
            union = None if a.keys() & b.keys() else dict(sorted((*a.items(), *b.items())))
            hit = self._unions[key] = (a, b, union)  # a and b kept alive: their ids stay theirs
        return hit[2]

    def _own_boxes(self, name: str) -> dict[int, tuple[Box, ...]]:
        """The tensor's boxes as this builder's own dict (a shared table is copied first)."""
        table = self._tables.pop(name, None)
        if table is not None:
            self._boxes[name] = dict(table)
        return self._boxes[name]

    def _add_checked(self, spec: TensorSpec, rank: int, box: Box) -> None:
        self.add_spec(spec)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise LayoutError(
                f"rank {rank!r} is not a non-negative integer", tensor=spec.name, field="rank"
            )
        if len(box) != len(spec.shape) or not within_shape(box, spec.shape):
            if spec.shape and is_empty(box) and len(box) == len(spec.shape):
                raise LayoutError("box is empty", tensor=spec.name, rank=rank, box=format_box(box))
            raise LayoutError(
                f"box out of range for shape {list(spec.shape)}",
                tensor=spec.name,
                rank=rank,
                box=format_box(box),
                field="boxes",
            )
        per_tensor = self._own_boxes(spec.name)
        per_rank = per_tensor.get(rank)
        if per_rank is None:
            per_tensor[rank] = (box,)
            return
        more = self._more.get((spec.name, rank))
        if more is None:
            more = self._more[(spec.name, rank)] = list(per_rank)
        more.append(box)
        self._several.add(spec.name)

    def _check_overlaps(self) -> None:
        """Raise LayoutError naming the first box that overlaps an earlier one of the same
        tensor and rank (earlier: in the order added)."""
        for (name, rank), boxes in self._more.items():
            pair = first_overlap(boxes)
            if pair is not None:
                first, later = (boxes[i] for i in pair)
                raise LayoutError(
                    f"overlaps box {format_box(first)} listed by the same rank",
                    tensor=name,
                    rank=rank,
                    box=format_box(later),
                    field="boxes",
                )

    def add_many(self, spec: TensorSpec, rank_boxes: Mapping[int, Iterable[Box]]) -> None:
        for rank, boxes in rank_boxes.items():
            for box in boxes:
                self.add(spec, rank, box)

    def merge(self, layout: Layout) -> None:
        specs, own = self._specs, self._boxes
        for t in layout.tensors.values():
            spec = t.spec
            if specs.get(spec.name) is not spec:
                self.add_spec(spec)
            per_rank_boxes = own.get(spec.name)
            shape = spec.shape
            for rank, boxes in t.boxes.items():
                # `add`'s fast path, inlined (a coordinator merges ~10^6 boxes that ranks
                # published): one box, for a rank with none yet, inside the shape.
                if (
                    per_rank_boxes is not None
                    and boxes.__class__ is tuple
                    and len(boxes) == 1
                    and rank.__class__ is int
                    and rank >= 0
                    and rank not in per_rank_boxes
                ):
                    box = boxes[0]
                    if len(box) == len(shape):
                        for (start, stop), n in zip(box, shape):  # noqa: B905 (lengths checked)
                            if not 0 <= start < stop <= n:
                                break
                        else:
                            per_rank_boxes[rank] = boxes
                            continue
                for box in boxes:
                    self.add(spec, rank, box)

    def build(self) -> Layout:
        self._check_overlaps()
        tensors = {}
        tables = self._tables
        # Tensors with equal boxes share one mapping (experts and layers repeat a handful):
        # less memory, and a digest or a planner does its work once per mapping object.
        shared: dict[tuple[tuple[int, tuple[Box, ...]], ...], dict[int, tuple[Box, ...]]] = {}
        with gc_paused():
            if len(tables) == len(self._specs):  # every tensor placed: the common case
                return Layout(
                    {name: TensorLayout(spec, tables[name]) for name, spec in self._specs.items()}
                )
            for name, spec in self._specs.items():
                table = tables.get(name)
                if table is not None:
                    tensors[name] = TensorLayout(spec, table)
                    continue
                per_rank = self._boxes[name]
                if name in self._several:
                    more = self._more
                    per_rank = {
                        rank: tuple(sorted(more.get((name, rank), b)))
                        for rank, b in per_rank.items()
                    }
                # Ranks in order, boxes sorted per rank; copies, so the builder may go on.
                boxes = dict(sorted(per_rank.items())) if len(per_rank) > 1 else dict(per_rank)
                try:
                    boxes = shared.setdefault(tuple(boxes.items()), boxes)
                except TypeError:  # a box given as lists: unhashable, kept as it is
                    pass
                tensors[name] = TensorLayout(spec, boxes)
        return Layout(tensors)


def merge_layouts(layouts: Iterable[Layout]) -> Layout:
    """Union of per-rank layouts (e.g. what each rank published) into one side's layout."""
    builder = LayoutBuilder()
    for layout in layouts:
        builder.merge(layout)
    return builder.build()
