"""The planner: who sends which box of which tensor to whom.

For every box a destination rank needs, the planner cuts it into pieces that each lie
inside one source holding and together cover it exactly once. Where several source
ranks hold the same box (data-parallel replicas, `Replicate()` placements), each piece
goes to the candidate with the fewest bytes to send so far (same host first when hosts
are known), so no sender becomes a hot spot.

Geometry is cached: tensors of the same shape held and needed through the same boxes
(every layer of a model, every expert) are cut once, whatever ranks hold them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from refitplane.errors import CoverageError, LayoutError
from refitplane.reshard.boxes import (
    Box,
    box_numel,
    format_box,
    intersect,
    pairwise_disjoint,
    subtract,
)
from refitplane.reshard.layout import Layout, TensorLayout, TensorSpec
from refitplane.reshard.plan import Link, Piece, Plan, plan_digest

# (piece box, index of the distinct source box it comes from, elements in the piece)
Cut = tuple[Box, int, int]


class _Uncovered(Exception):
    def __init__(self, box: Box) -> None:
        super().__init__(box)
        self.box = box


@dataclass
class _Cutter:
    """Cuts needed boxes against a tuple of distinct holder boxes, with caching."""

    disjoint: dict[tuple[Box, ...], bool]
    cuts: dict[tuple[tuple[Box, ...], Box], tuple[Cut, ...]]

    def cut(self, holders: tuple[Box, ...], need: Box) -> tuple[Cut, ...]:
        """The cuts covering `need`; raises `_Uncovered` with the first uncovered sub-box."""
        key = (holders, need)
        hit = self.cuts.get(key)
        if hit is None:
            hit = self._cut(holders, need)
            self.cuts[key] = hit
        return hit

    def _cut(self, holders: tuple[Box, ...], need: Box) -> tuple[Cut, ...]:
        disjoint = self.disjoint.get(holders)
        if disjoint is None:
            disjoint = pairwise_disjoint(holders)
            self.disjoint[holders] = disjoint
        if disjoint:
            cuts: list[Cut] = []
            covered = 0
            for i, h in enumerate(holders):
                common = intersect(need, h)
                if common is not None:
                    n = box_numel(common)
                    cuts.append((common, i, n))
                    covered += n
            if covered == box_numel(need):
                return tuple(cuts)
            raise _Uncovered(_first_uncovered(need, [c for c, _, _ in cuts]))
        # Overlapping holdings: repeatedly take the holder covering most of what is left.
        remaining = [need]
        out: list[Cut] = []
        while remaining:
            part = remaining.pop()
            best: tuple[int, int, Box] | None = None
            for i, h in enumerate(holders):
                common = intersect(part, h)
                if common is not None:
                    n = box_numel(common)
                    if best is None or n > best[0]:
                        best = (n, i, common)
            if best is None:
                raise _Uncovered(part)
            out.append((best[2], best[1], best[0]))
            remaining.extend(subtract(part, best[2]))
        out.sort()
        return tuple(out)


def _first_uncovered(need: Box, covered: list[Box]) -> Box:
    remaining = [need]
    for c in covered:
        remaining = [r for part in remaining for r in subtract(part, c)]
    return remaining[0]


def _check_spec(name: str, source: TensorSpec, target: TensorSpec) -> None:
    if source.shape != target.shape:
        raise LayoutError(
            f"source has shape {list(source.shape)}, destination expects {list(target.shape)}",
            tensor=name,
            field="shape",
        )
    if source.dtype != target.dtype:
        raise LayoutError(
            f"source has dtype {source.dtype}, destination expects {target.dtype}",
            tensor=name,
            field="dtype",
        )


def validate_compatible(source: Layout, target: Layout, *, allow_unused: bool = False) -> None:
    """Every tensor the destination needs exists on the source with the same spec, and
    (unless `allow_unused`) every tensor the source holds is needed: a trainer tensor no
    generator has means the two sides run different models."""
    for t in target:
        held = source.tensors.get(t.spec.name)
        if held is None:
            needers = t.ranks()
            raise LayoutError(
                f"needed by {len(needers)} destination rank(s) but no source rank holds it",
                tensor=t.spec.name,
                rank=needers[0] if needers else None,
            )
        _check_spec(t.spec.name, held.spec, t.spec)
    if not allow_unused:
        for name in sorted(source.tensors):
            if name not in target.tensors:
                holders = source.tensors[name].ranks()
                raise LayoutError(
                    "held by the source but no destination needs it: the generator's model "
                    "has no such tensor (different models on the two sides?)",
                    tensor=name,
                    rank=holders[0] if holders else None,
                )


def build_plan(
    source: Layout,
    target: Layout,
    *,
    hosts: Mapping[int, str] | None = None,
    allow_unused: bool = False,
) -> Plan:
    """Plan the transfer of everything `target` needs from what `source` holds.

    Source and target ranks must already be distinct group ranks. `hosts` (rank → host
    name) makes the balancer prefer senders on the destination's host. `allow_unused`
    accepts source tensors that no destination needs (e.g. trainer-only heads).
    """
    validate_compatible(source, target, allow_unused=allow_unused)
    overlap = set(source.ranks()) & set(target.ranks())
    if overlap:
        raise LayoutError(
            f"rank(s) {sorted(overlap)[:8]} appear on both sides; relabel to group ranks first",
            field="rank",
        )
    cutter = _Cutter({}, {})
    send_load: dict[int, int] = dict.fromkeys(source.ranks(), 0)
    # Per destination rank, per source rank: the link's pieces and bytes so far (keyed by
    # plain ints: no (src, dst) tuple is built or hashed per piece).
    link_pieces: dict[int, dict[int, list[Piece]]] = {}
    link_load: dict[int, dict[int, int]] = {}
    specs: dict[str, TensorSpec] = {}
    host_of = hosts or {}

    with _gc_paused():
        for t in target:
            name = t.spec.name
            holders, owners = _distinct_holders(source.tensors[name])
            size = t.spec.itemsize
            specs[name] = t.spec
            # Common case (experts, replicated weights): one box held, wanted whole.
            only = holders[0] if len(holders) == 1 else None
            whole: tuple[Cut, ...] = ((only, 0, box_numel(only)),) if only is not None else ()
            # Replicas need the same boxes: one Piece object per box of this tensor.
            pieces_of: dict[Box, Piece] = {}
            for dst in sorted(t.boxes):
                dst_host = host_of.get(dst) if host_of else None
                to_dst = link_pieces.get(dst)
                if to_dst is None:
                    to_dst = link_pieces[dst] = {}
                    link_load[dst] = {}
                load_to_dst = link_load[dst]
                for need in t.boxes[dst]:
                    try:
                        cuts = whole if need == only else cutter.cut(holders, need)
                    except _Uncovered as gap:
                        raise CoverageError(
                            f"no source rank holds this part of the needed box {format_box(need)}",
                            tensor=name,
                            rank=dst,
                            box=format_box(gap.box),
                        ) from None
                    for box, idx, numel in cuts:
                        nbytes = numel * size
                        candidates = owners[idx]
                        if len(candidates) == 1:
                            src = candidates[0]
                        else:
                            src = _pick_sender(
                                candidates, dst_host, host_of, send_load, load_to_dst
                            )
                        send_load[src] += nbytes
                        piece = pieces_of.get(box)
                        if piece is None:
                            piece = pieces_of[box] = Piece(name, box)
                        pieces = to_dst.get(src)
                        if pieces is None:
                            to_dst[src] = [piece]
                            load_to_dst[src] = nbytes
                        else:
                            pieces.append(piece)
                            load_to_dst[src] += nbytes

        pairs = sorted((src, dst) for dst, by_src in link_pieces.items() for src in by_src)
        links = tuple(
            Link(src=s, dst=d, pieces=tuple(link_pieces[d][s]), nbytes=link_load[d][s])
            for s, d in pairs
        )

    host_key = ",".join(f"{r}={h}" for r, h in sorted(host_of.items()))
    return Plan(
        specs=specs,
        links=links,
        digest=plan_digest(source.digest, target.digest, host_key),
        source_ranks=tuple(source.ranks()),
        target_ranks=tuple(target.ranks()),
    )


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning allocates ~10^6 small objects and no cycles; generational GC passes over
    them would cost more than the planning itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _distinct_holders(held: TensorLayout) -> tuple[tuple[Box, ...], list[list[int]]]:
    """Distinct boxes held (sorted) and, for each, the ranks holding exactly that box."""
    if len(held.boxes) == 1:
        ((rank, boxes),) = held.boxes.items()
        if len(boxes) == 1:
            return boxes, [[rank]]
    by_box: dict[Box, list[int]] = {}
    for rank, boxes in held.boxes.items():
        for box in boxes:
            by_box.setdefault(box, []).append(rank)
    holders = tuple(sorted(by_box))
    return holders, [sorted(by_box[b]) for b in holders]


def _pick_sender(
    candidates: list[int],
    dst_host: str | None,
    host_of: Mapping[int, str],
    send_load: Mapping[int, int],
    load_to_dst: Mapping[int, int],
) -> int:
    """The candidate with the least (remote, bytes to send, bytes on its link to the
    destination) — `load_to_dst` is by source rank — the first one on ties."""
    best = candidates[0]
    if not host_of:
        # The first candidate with the least (bytes to send, bytes on its link to dst); the
        # link's load is looked up only to break a tie on the first.
        best_send = send_load[best]
        best_link = -1
        for c in candidates[1:]:
            c_send = send_load[c]
            if c_send < best_send:
                best, best_send, best_link = c, c_send, -1
            elif c_send == best_send:
                if best_link < 0:
                    best_link = load_to_dst.get(best, 0)
                c_link = load_to_dst.get(c, 0)
                if c_link < best_link:
                    best, best_link = c, c_link
        return best
    best_key: tuple[bool, int, int] | None = None
    for c in candidates:
        remote = dst_host is not None and host_of.get(c) != dst_host
        key = (remote, send_load[c], load_to_dst.get(c, 0))
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best
