"""The planner: who sends which box of which tensor to whom.

For every box a destination rank needs, the planner cuts it into pieces that each lie
inside one source holding and together cover it exactly once. Where several source
ranks hold the same box (data-parallel replicas, `Replicate()` placements), each piece
goes to the candidate with the fewest bytes to send so far (same host first when hosts
are known), so no sender becomes a hot spot.

Geometry is cached: tensors of the same shape held and needed through the same boxes
(every layer of a model, every expert) are cut once, whatever ranks hold them; tensors whose
two rank-to-boxes mappings are the same objects (a builder shares them) are planned from one
template, replayed per tensor. The plan is the one the rule above gives tensor by tensor,
destination by destination (`tests/unit/reshard/test_planner.py` checks it against a plain
implementation of the rule).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import repeat

from refitplane.errors import CoverageError, LayoutError
from refitplane.reshard.boxes import (
    Box,
    box_numel,
    format_box,
    intersect,
    pairwise_disjoint,
    subtract,
)
from refitplane.reshard.dtypes import ITEMSIZE
from refitplane.reshard.layout import Layout, TensorLayout, TensorSpec, gc_paused
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
    held_by_name = source.tensors
    for t in target:
        held = held_by_name.get(t.spec.name)
        if held is None:
            needers = t.ranks()
            raise LayoutError(
                f"needed by {len(needers)} destination rank(s) but no source rank holds it",
                tensor=t.spec.name,
                rank=needers[0] if needers else None,
            )
        if held.spec is not t.spec:
            _check_spec(t.spec.name, held.spec, t.spec)
    # A set difference first (in C): the sorted walk only when some tensor is unused.
    if not allow_unused and source.tensors.keys() - target.tensors.keys():
        for name in source.names():
            if name not in target.tensors:
                holders = source.tensors[name].ranks()
                raise LayoutError(
                    "held by the source but no destination needs it: the generator's model "
                    "has no such tensor (different models on the two sides?)",
                    tensor=name,
                    rank=holders[0] if holders else None,
                )


# One cut of a needed box as the planner runs it: the destination's links (pieces and
# bytes by source rank, this plan's own dicts), the destination's host, the index of the
# piece's box in the template, the candidate senders (in rank order), the elements.
_Step = tuple[dict[int, list[Piece]], dict[int, int], str | None, int, tuple[int, ...], int]


@dataclass(slots=True, eq=False)
class _Template:
    """How one (held boxes, needed boxes) pair of mappings is planned: made once per pair of
    mapping objects and replayed for every tensor that shares them (layers, experts)."""

    boxes: tuple[Box, ...]  # distinct piece boxes: one Piece each per tensor
    steps: tuple[_Step, ...]  # every cut, destinations in rank order, needs and cuts in order
    # Set when every cut has one candidate sender (an expert): nothing to balance, so the
    # pieces are appended in order (per cut: its link's `append`, the piece's box index)
    # but the bytes they add are summed per link and sender, and added later in bulk.
    fixed: tuple[tuple[Callable[[Piece], None], int], ...] | None
    fixed_links: tuple[tuple[dict[int, int], int, int], ...]  # (dst's bytes by src, src, elements)
    fixed_sends: tuple[tuple[int, int], ...]  # (src, elements)
    # Every cut has the same several candidates (a replicated tensor: every rank of a stage
    # holds it whole), so `_balance_one_set` may plan it.
    one_set: bool


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
    # Keyed by the ids of the two mappings, which both layouts keep alive meanwhile.
    templates: dict[tuple[int, int], _Template] = {}
    held_by_name = source.tensors
    needed_by_name = target.tensors
    sends_of = send_load.__getitem__

    # Bytes of fixed templates' tensors not yet added to the loads, as elements times the
    # summed item sizes per template: added before any choice reads the loads.
    pending: dict[_Template, int] = {}

    with gc_paused():
        for key in target.names():
            t = needed_by_name[key]
            spec = t.spec
            name = spec.name
            specs[name] = spec
            held = held_by_name[name]
            template = templates.get((id(held.boxes), id(t.boxes)))
            if template is None:
                template = templates[id(held.boxes), id(t.boxes)] = _template(
                    name, held, t, cutter, host_of, link_pieces, link_load
                )
            size = ITEMSIZE[spec.dtype]
            fixed = template.fixed
            if fixed is not None:
                boxes = template.boxes
                if len(boxes) == 1:  # replicas need the same box: one Piece for all
                    piece = Piece(name, boxes[0])
                    for append, _ in fixed:
                        append(piece)
                else:
                    pieces = [*map(Piece, repeat(name), boxes)]
                    for append, index in fixed:
                        append(pieces[index])
                pending[template] = pending.get(template, 0) + size
                continue
            if pending:
                _add_pending(pending, send_load)
            # Replicas need the same boxes: one Piece object per box of this tensor.
            pieces = [*map(Piece, repeat(name), template.boxes)]
            if template.one_set and not host_of:
                _balance_one_set(template.steps, pieces, size, send_load)
                continue
            for to_dst, load_to_dst, dst_host, index, candidates, numel in template.steps:
                nbytes = numel * size
                if len(candidates) == 1:
                    src = candidates[0]
                elif host_of:
                    src = _pick_sender(candidates, dst_host, host_of, send_load, load_to_dst)
                else:
                    # The first candidate with the least (bytes to send, bytes on its link
                    # to dst): candidates are in rank order, so the least (send, link,
                    # rank), compared in C. The template put every candidate's link in
                    # `load_to_dst`.
                    src = min(
                        zip(
                            map(sends_of, candidates),
                            map(load_to_dst.__getitem__, candidates),
                            candidates,
                            strict=True,
                        )
                    )[2]
                send_load[src] += nbytes
                to_link = to_dst.get(src)
                if to_link is None:
                    to_dst[src] = [pieces[index]]
                    load_to_dst[src] = nbytes
                else:
                    to_link.append(pieces[index])
                    load_to_dst[src] += nbytes
        _add_pending(pending, send_load)

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


def _template(
    name: str,
    held: TensorLayout,
    needed: TensorLayout,
    cutter: _Cutter,
    host_of: Mapping[int, str],
    link_pieces: dict[int, dict[int, list[Piece]]],
    link_load: dict[int, dict[int, int]],
) -> _Template:
    """Cut every needed box of `needed` against the distinct boxes of `held`; raises
    CoverageError naming `name` (the first tensor planned this way) for a gap."""
    holders, owners = _distinct_holders(held)
    # Common case (experts, replicated weights): one box held, wanted whole.
    only = holders[0] if len(holders) == 1 else None
    whole: tuple[Cut, ...] = ((only, 0, box_numel(only)),) if only is not None else ()
    box_index: dict[Box, int] = {}
    steps: list[_Step] = []
    for dst in sorted(needed.boxes):
        to_dst = link_pieces.get(dst)
        if to_dst is None:
            to_dst = link_pieces[dst] = {}
            link_load[dst] = {}
        load_to_dst = link_load[dst]
        dst_host = host_of.get(dst)
        for need in needed.boxes[dst]:
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
                candidates = owners[idx]
                if len(candidates) > 1:
                    # A link with no piece yet has 0 bytes (what `.get(c, 0)` gave): listed
                    # up front, so the balancer looks loads up with a plain `__getitem__`.
                    for c in candidates:
                        load_to_dst.setdefault(c, 0)
                index = box_index.setdefault(box, len(box_index))
                steps.append((to_dst, load_to_dst, dst_host, index, candidates, numel))
    fixed: list[tuple[Callable[[Piece], None], int]] | None = None
    fixed_links: dict[tuple[int, int], tuple[dict[int, int], int, int]] = {}
    fixed_sends: dict[int, int] = {}
    if all(len(step[4]) == 1 for step in steps):
        fixed = []
        for to_dst, load_to_dst, _, index, (src,), numel in steps:
            to_link = to_dst.get(src)
            if to_link is None:
                to_link = to_dst[src] = []
                load_to_dst[src] = 0
            fixed.append((to_link.append, index))
            link_key = (id(load_to_dst), src)
            summed = fixed_links.get(link_key, (load_to_dst, src, 0))[2] + numel
            fixed_links[link_key] = (load_to_dst, src, summed)
            fixed_sends[src] = fixed_sends.get(src, 0) + numel
    first = steps[0][4] if steps else ()
    return _Template(
        boxes=tuple(box_index),
        steps=tuple(steps),
        fixed=None if fixed is None else tuple(fixed),
        fixed_links=tuple(fixed_links.values()),
        fixed_sends=tuple(fixed_sends.items()),
        one_set=len(first) > 1 and all(step[4] == first for step in steps),
    )


def _add_pending(pending: dict[_Template, int], send_load: dict[int, int]) -> None:
    """Add the bytes of the fixed templates' tensors planned since the last call."""
    for template, sizes in pending.items():
        for load_to_dst, src, numel in template.fixed_links:
            load_to_dst[src] += numel * sizes
        for src, numel in template.fixed_sends:
            send_load[src] += numel * sizes
    pending.clear()


def _balance_one_set(
    steps: tuple[_Step, ...], pieces: list[Piece], size: int, send_load: dict[int, int]
) -> None:
    """Plan cuts that all have the same candidates, choosing for each, as the general loop
    does, the first candidate with the least (bytes to send, bytes on its link to the
    destination) — in fewer steps. Only these cuts change what the candidates send
    meanwhile, so candidates are kept grouped by bytes to send (each group in rank order, a
    heap of the amounts): each cut looks only at the group sending least — replicas that
    have sent the same, often most of them — for the least link."""
    candidates = steps[0][4]
    groups: dict[int, list[int]] = {}
    for c in candidates:  # in rank order
        groups.setdefault(send_load[c], []).append(c)
    amounts = list(groups)
    heapify(amounts)
    for to_dst, load_to_dst, _, index, _, numel in steps:
        nbytes = numel * size
        least = amounts[0]
        group = groups[least]
        # The template put every candidate's link in `load_to_dst`.
        src = group[0] if len(group) == 1 else min(group, key=load_to_dst.__getitem__)
        group.remove(src)
        if not group:
            heappop(amounts)
            del groups[least]
        sent = send_load[src] = least + nbytes
        moved_to = groups.get(sent)
        if moved_to is None:
            groups[sent] = [src]
            heappush(amounts, sent)
        else:
            insort(moved_to, src)
        to_link = to_dst.get(src)
        if to_link is None:
            to_dst[src] = [pieces[index]]
            load_to_dst[src] = nbytes
        else:
            to_link.append(pieces[index])
            load_to_dst[src] += nbytes


def _distinct_holders(held: TensorLayout) -> tuple[tuple[Box, ...], list[tuple[int, ...]]]:
    """Distinct boxes held (sorted) and, for each, the ranks holding exactly that box."""
    if len(held.boxes) == 1:
        ((rank, boxes),) = held.boxes.items()
        if len(boxes) == 1:
            return boxes, [(rank,)]
    by_box: dict[Box, list[int]] = {}
    for rank, boxes in held.boxes.items():
        for box in boxes:
            by_box.setdefault(box, []).append(rank)
    holders = tuple(sorted(by_box))
    return holders, [tuple(sorted(by_box[b])) for b in holders]


def _pick_sender(
    candidates: tuple[int, ...],
    dst_host: str | None,
    host_of: Mapping[int, str],
    send_load: Mapping[int, int],
    load_to_dst: Mapping[int, int],
) -> int:
    """With hosts known: the candidate with the least (remote, bytes to send, bytes on its
    link to the destination) — `load_to_dst` is by source rank — the first one on ties."""
    best = candidates[0]
    best_key: tuple[bool, int, int] | None = None
    for c in candidates:
        remote = dst_host is not None and host_of.get(c) != dst_host
        key = (remote, send_load[c], load_to_dst.get(c, 0))
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best
