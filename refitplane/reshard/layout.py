"""Layouts: for every canonical tensor, its spec and the boxes each rank holds or needs.

Canonical names are Hugging Face checkpoint names. The same type describes both sides:
on the source (trainer) side a rank's boxes are what it *holds*, on the destination
(generator) side what it *needs*. Ranks on the two sides live in separate namespaces
until the coordinator maps them onto group ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import (
    Box,
    box_numel,
    format_box,
    intersect,
    is_empty,
    within_shape,
)
from refitplane.reshard.dtypes import canonical_dtype, itemsize

# Limits that keep a malformed layout from exhausting memory in the planner.
MAX_DIMS = 8
MAX_DIM_SIZE = 1 << 40


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
    """All tensors of one side, by canonical name (iteration is in sorted name order)."""

    tensors: Mapping[str, TensorLayout]
    _hash: list[str] = field(default_factory=list, repr=False, compare=False)

    def __iter__(self) -> Iterator[TensorLayout]:
        for name in sorted(self.tensors):
            yield self.tensors[name]

    def __len__(self) -> int:
        return len(self.tensors)

    def ranks(self) -> list[int]:
        out: set[int] = set()
        for t in self.tensors.values():
            out.update(t.boxes)
        return sorted(out)

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
        return Layout(
            {
                name: TensorLayout(t.spec, {mapping[r]: b for r, b in t.boxes.items()})
                for name, t in self.tensors.items()
            }
        )

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
        if not self._hash:
            self._hash.append(_digest(self))
        return self._hash[0]


def _digest(layout: Layout) -> str:
    """sha256 over, per tensor in name order, `name|shape|dtype`, then `|rank:[boxes]` per
    rank in order (boxes sorted), then a newline. Fed in large chunks (the same bytes as
    one update per field), and the text of each rank-to-boxes mapping is made once: a model
    repeats the same mapping over its layers and experts."""
    h = hashlib.sha256()
    mapping_text: dict[tuple[tuple[int, tuple[Box, ...]], ...], str] = {}
    parts: list[str] = []
    tensors = layout.tensors
    for name in sorted(tensors):
        t = tensors[name]
        s = t.spec
        parts.append(f"{s.name}|{s.shape}|{s.dtype}")
        boxes = t.boxes
        items = tuple(boxes.items())
        try:
            text = mapping_text.get(items)
        except TypeError:  # a box given as lists: unhashable, and never shared
            text, items = None, ()
        if text is None:
            text = "".join(f"|{rank}:{sorted(boxes[rank])}" for rank in sorted(boxes))
            if items:
                mapping_text[items] = text
        parts.append(text)
        parts.append("\n")
        if len(parts) >= 3 * 4096:
            h.update("".join(parts).encode())
            parts.clear()
    h.update("".join(parts).encode())
    return h.hexdigest()


class LayoutBuilder:
    """Accumulates (spec, rank, box) entries from any number of ranks and validates them.

    Errors name the tensor, rank and box: specs that disagree between ranks, boxes out of
    range or of the wrong rank, empty boxes, a rank listing the same element twice.
    """

    def __init__(self) -> None:
        self._specs: dict[str, TensorSpec] = {}
        # Per tensor, per rank, the boxes in the order added (sorted by `build`)
        self._boxes: dict[str, dict[int, tuple[Box, ...]]] = {}
        # Tensors with a rank listing more than one box (only those need their boxes sorted)
        self._several: set[str] = set()

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
                    per_rank_boxes = self._boxes[spec.name]
                    if rank not in per_rank_boxes:
                        per_rank_boxes[rank] = (box,)
                        return
        self._add_checked(spec, rank, box)

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
        per_tensor = self._boxes[spec.name]
        per_rank = per_tensor.get(rank, ())
        for other in per_rank:
            if intersect(other, box) is not None:
                raise LayoutError(
                    f"overlaps box {format_box(other)} listed by the same rank",
                    tensor=spec.name,
                    rank=rank,
                    box=format_box(box),
                    field="boxes",
                )
        per_tensor[rank] = (*per_rank, box)
        if per_rank:
            self._several.add(spec.name)

    def add_many(self, spec: TensorSpec, rank_boxes: Mapping[int, Iterable[Box]]) -> None:
        for rank, boxes in rank_boxes.items():
            for box in boxes:
                self.add(spec, rank, box)

    def merge(self, layout: Layout) -> None:
        for t in layout.tensors.values():
            self.add_spec(t.spec)
            for rank, boxes in t.boxes.items():
                for box in boxes:
                    self.add(t.spec, rank, box)

    def build(self) -> Layout:
        tensors = {}
        for name, spec in self._specs.items():
            per_rank = self._boxes[name]
            if name in self._several:
                per_rank = {rank: tuple(sorted(b)) for rank, b in per_rank.items()}
            # Ranks in order, boxes sorted per rank; copies, so the builder may go on.
            boxes = dict(sorted(per_rank.items())) if len(per_rank) > 1 else dict(per_rank)
            tensors[name] = TensorLayout(spec, boxes)
        return Layout(tensors)


def merge_layouts(layouts: Iterable[Layout]) -> Layout:
    """Union of per-rank layouts (e.g. what each rank published) into one side's layout."""
    builder = LayoutBuilder()
    for layout in layouts:
        builder.merge(layout)
    return builder.build()
