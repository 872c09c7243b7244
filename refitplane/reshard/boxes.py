"""Boxes: half-open index ranges per dimension of a global tensor.

A box is a plain tuple of `(start, stop)` pairs, one per dimension, so it hashes, compares
and serialises cheaply; plans for ~100k tensors hold hundreds of thousands of them.
A zero-dimensional tensor has the empty box `()`, which holds one element.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence

Range = tuple[int, int]
Box = tuple[Range, ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def is_empty(box: Box) -> bool:
    return any(stop <= start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None if they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def within_shape(box: Box, shape: Sequence[int]) -> bool:
    if len(box) != len(shape):
        return False
    return all(0 <= start < stop <= n for (start, stop), n in zip(box, shape, strict=True))


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as disjoint boxes (at most two per dimension)."""
    common = intersect(a, b)
    if common is None:
        return [a]
    pieces: list[Box] = []
    rest = list(a)
    for dim, ((r0, r1), (c0, c1)) in enumerate(zip(a, common, strict=True)):
        if r0 < c0:
            pieces.append((*rest[:dim], (r0, c0), *rest[dim + 1 :]))
        if c1 < r1:
            pieces.append((*rest[:dim], (c1, r1), *rest[dim + 1 :]))
        rest[dim] = (c0, c1)
    return pieces


def relative(inner: Box, outer: Box) -> Box:
    """`inner` in the coordinates of `outer` (which must contain it)."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def format_box(box: Box) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


def pairwise_disjoint(boxes: Iterable[Box]) -> bool:
    return first_overlap(list(boxes)) is None


def first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Indices `(i, j)`, `i < j`, of two boxes that overlap, or None: a sweep, not the
    O(n^2) pairwise test (a hostile layout lists 10^4-10^5 boxes for one tensor).

    Boxes are swept in start order along the dimension where their starts differ most (rows
    for a row split, columns for a column split). The boxes crossing the sweep line at a
    start are pairwise disjoint in the other dimensions if no overlap was found so far; for
    one or two dimensions that makes them disjoint intervals of the second dimension, kept
    sorted, so each box is checked against its two neighbours: O(n log n). With three or
    more dimensions the crossing boxes whose second-dimension interval meets the new box
    are compared in full: a 3-D grid of n cells costs O(n^(4/3)), which the cap on boxes per
    tensor bounds."""
    n = len(boxes)
    if n < 2:
        return None
    dims = len(boxes[0])
    if dims == 0:  # a scalar's one element, listed twice
        return (0, 1)
    if any(len(b) != dims for b in boxes):
        raise ValueError("boxes of different ranks")
    if dims == 1:
        sweep, other = 0, -1
    else:
        spread = sorted(range(dims), key=lambda d: len({b[d][0] for b in boxes}), reverse=True)
        sweep, other = spread[0], spread[1]
    order = sorted(range(n), key=lambda i: boxes[i][sweep][0])
    ending: list[tuple[int, int]] = []  # heap of (sweep stop, index) of the crossing boxes
    starts: list[int] = []  # crossing boxes' starts in `other`, sorted ...
    members: list[int] = []  # ... and their indices, in the same order
    longest = max(b[other][1] - b[other][0] for b in boxes) if other >= 0 else 1
    for i in order:
        box = boxes[i]
        start, _ = box[sweep]
        while ending and ending[0][0] <= start:
            _, done = heapq.heappop(ending)
            at = bisect.bisect_left(starts, boxes[done][other][0] if other >= 0 else 0)
            while members[at] != done:
                at += 1
            del starts[at], members[at]
        lo, hi = box[other] if other >= 0 else (0, 1)
        at = bisect.bisect_right(starts, lo)
        if dims <= 2:
            # Disjoint intervals: only the one starting at or before `lo` and the one after
            # can reach into [lo, hi).
            for k in (at - 1, at):
                if 0 <= k < len(members) and intersect(boxes[members[k]], box) is not None:
                    return (min(i, members[k]), max(i, members[k]))
        else:
            # Only boxes starting less than the longest interval before `lo` can reach it.
            first = bisect.bisect_left(starts, lo - longest + 1)
            for k in range(first, bisect.bisect_left(starts, hi)):
                if intersect(boxes[members[k]], box) is not None:
                    return (min(i, members[k]), max(i, members[k]))
        heapq.heappush(ending, (box[sweep][1], i))
        starts.insert(at, lo)
        members.insert(at, i)
    return None


def split_rows(box: Box, max_elems: int) -> list[Box]:
    """Split `box` into boxes of at most `max_elems` elements, cutting the outermost
    dimension that still has more than one index, so each part stays a dense sub-box."""
    total = box_numel(box)
    if total <= max_elems or not box:
        return [box]
    for dim, (start, stop) in enumerate(box):
        extent = stop - start
        inner = total // extent if extent else 0
        if extent > 1 and inner <= max_elems:
            step = max(1, max_elems // inner)
            return [
                (*box[:dim], (s, min(s + step, stop)), *box[dim + 1 :])
                for s in range(start, stop, step)
            ]
        if extent > 1:
            # One index of this dimension is already too large: recurse into each index.
            parts: list[Box] = []
            for s in range(start, stop):
                parts.extend(split_rows((*box[:dim], (s, s + 1), *box[dim + 1 :]), max_elems))
            return parts
    return [box]
