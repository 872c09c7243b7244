"""The reshard core's types (boxes, tensor specs, layouts, rank plans, transfer config) ↔
`refit.v1` common messages.

Conversions from protobuf validate: anything malformed raises `InvalidArgument`/`LayoutError`
whose `field` is the path of the bad field in the request (e.g. `layout.tensors[3].boxes[0]`),
and whose message names the tensor, rank and box.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.errors import InvalidArgument, LayoutError
from refitplane.reshard.boxes import Box, format_box
from refitplane.reshard.config import DELTA_MAX_CHANGED, DIRECT_MIN_BYTES, TransferConfig
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan

# A layout with more tensors than this is refused before any work is done on it (the largest
# MoE checkpoints have ~10^5 tensors).
MAX_LAYOUT_TENSORS = 1_000_000

_L = TypeVar("_L", bound=LayoutError)


def _at(exc: _L, path: str) -> _L:
    """The same error, with `field` set to the request path of the offending value."""
    new = type(exc)(exc.message, field=path)
    new.tensor, new.rank, new.box = exc.tensor, exc.rank, exc.box
    return new


def box_to_proto(box: Box) -> cpb.Box:
    return cpb.Box(start=[a for a, _ in box], stop=[b for _, b in box])


def box_from_proto(msg: cpb.Box, *, field: str, tensor: str | None = None) -> Box:
    if len(msg.start) != len(msg.stop):
        raise LayoutError(
            f"box has {len(msg.start)} start values but {len(msg.stop)} stop values",
            tensor=tensor,
            field=field,
        )
    return tuple(zip(msg.start, msg.stop, strict=True))


def spec_to_proto(spec: TensorSpec) -> cpb.TensorSpec:
    return cpb.TensorSpec(name=spec.name, shape=spec.shape, dtype=spec.dtype)


def spec_from_proto(msg: cpb.TensorSpec, *, field: str) -> TensorSpec:
    try:
        return TensorSpec.create(msg.name, list(msg.shape), msg.dtype)
    except LayoutError as exc:
        raise _at(exc, f"{field}.{exc.field or 'name'}") from None


def layout_to_proto(layout: Layout, rank: int) -> cpb.RankLayout:
    """The part of `layout` that `rank` holds or needs, as a RankLayout (which has no rank:
    the coordinator knows it from the member)."""
    out = cpb.RankLayout()
    for t in layout:
        boxes = t.boxes.get(rank)
        if boxes:
            out.tensors.append(
                cpb.TensorBoxes(spec=spec_to_proto(t.spec), boxes=[box_to_proto(b) for b in boxes])
            )
    return out


def layout_chunks(layout: cpb.RankLayout, max_bytes: int) -> list[cpb.RankLayout]:
    """`layout` cut into parts of at most about `max_bytes` serialized, in order; a tensor
    whose boxes alone are larger is split over several entries (same spec, part of the
    boxes), which the coordinator puts together again."""
    chunks: list[cpb.RankLayout] = []
    current = cpb.RankLayout()
    size = 0

    def emit() -> None:
        nonlocal current, size
        if current.tensors:
            chunks.append(current)
        current, size = cpb.RankLayout(), 0

    for entry in layout.tensors:
        entry_bytes = entry.ByteSize() + 8  # + the field tag and length prefix
        if size + entry_bytes > max_bytes:
            emit()
        if entry_bytes <= max_bytes:
            current.tensors.append(entry)
            size += entry_bytes
            continue
        part = cpb.TensorBoxes(spec=entry.spec)
        for box in entry.boxes:
            if part.boxes and part.ByteSize() + box.ByteSize() + 8 > max_bytes:
                current.tensors.append(part)
                emit()
                part = cpb.TensorBoxes(spec=entry.spec)
            part.boxes.append(box)
        current.tensors.append(part)
        size = part.ByteSize() + 8
    emit()
    return chunks or [cpb.RankLayout()]


def layout_from_proto(
    msg: cpb.RankLayout,
    rank: int,
    *,
    field: str = "layout",
    max_boxes_per_tensor: int | None = None,
    max_boxes_setting: str = "REFIT_MAX_BOXES_PER_TENSOR",
) -> Layout:
    """Validate and convert what one rank published; every error names the request path.
    `max_boxes_per_tensor`: refuse a tensor listed with more boxes, naming the cap (the
    setting `max_boxes_setting`) before any of them is checked."""
    if len(msg.tensors) > MAX_LAYOUT_TENSORS:
        raise LayoutError(
            f"{len(msg.tensors)} tensors (at most {MAX_LAYOUT_TENSORS})", field=f"{field}.tensors"
        )
    builder = LayoutBuilder()
    entry_of: dict[str, int] = {}  # tensor → its (first) entry, to name overlaps by path
    boxes_of: dict[str, int] = {}
    for i, entry in enumerate(msg.tensors):
        path = f"{field}.tensors[{i}]"
        if not entry.HasField("spec"):
            raise LayoutError("spec is missing", field=f"{path}.spec")
        spec = spec_from_proto(entry.spec, field=f"{path}.spec")
        if not entry.boxes:
            raise LayoutError("lists no boxes", tensor=spec.name, rank=rank, field=f"{path}.boxes")
        entry_of.setdefault(spec.name, i)
        boxes_of[spec.name] = boxes_of.get(spec.name, 0) + len(entry.boxes)
        if max_boxes_per_tensor is not None and boxes_of[spec.name] > max_boxes_per_tensor:
            raise LayoutError(
                f"{boxes_of[spec.name]} boxes for one tensor (at most {max_boxes_per_tensor}: "
                f"{max_boxes_setting})",
                tensor=spec.name,
                rank=rank,
                field=f"{path}.boxes",
            )
        try:
            builder.add_spec(spec)
        except LayoutError as exc:
            raise _at(exc, f"{path}.spec.{exc.field or 'name'}") from None
        for j, box_msg in enumerate(entry.boxes):
            box_path = f"{path}.boxes[{j}]"
            box = box_from_proto(box_msg, field=box_path, tensor=spec.name)
            try:
                builder.add(spec, rank, box)
            except LayoutError as exc:
                raise _at(exc, box_path) from None
    try:
        return builder.build()
    except LayoutError as exc:
        # An overlap, found once all boxes are in: name the later box by its path.
        at = entry_of.get(exc.tensor or "")
        if at is None:
            raise
        for j, box_msg in enumerate(msg.tensors[at].boxes):
            if format_box(tuple(zip(box_msg.start, box_msg.stop, strict=True))) == exc.box:
                raise _at(exc, f"{field}.tensors[{at}].boxes[{j}]") from None
        raise _at(exc, f"{field}.tensors[{at}].boxes") from None


# --- plans, transfer config -----------------------------------------------------------------


def _links_to_proto(links: tuple[Link, ...], index: Mapping[str, int]) -> list[cpb.Link]:
    return [
        cpb.Link(
            src=link.src,
            dst=link.dst,
            nbytes=link.nbytes,
            pieces=[
                cpb.Piece(tensor=index[p.tensor], box=box_to_proto(p.box)) for p in link.pieces
            ],
        )
        for link in links
    ]


def rank_plan_to_proto(plan: RankPlan) -> cpb.RankPlan:
    names = sorted(plan.specs)
    index = {n: i for i, n in enumerate(names)}
    return cpb.RankPlan(
        rank=plan.rank,
        plan_digest=plan.plan_digest,
        specs=[spec_to_proto(plan.specs[n]) for n in names],
        sends=_links_to_proto(plan.sends, index),
        recvs=_links_to_proto(plan.recvs, index),
    )


def _links_from_proto(links: list[cpb.Link], names: list[str], field: str) -> tuple[Link, ...]:
    out = []
    for i, link in enumerate(links):
        pieces = []
        for j, piece in enumerate(link.pieces):
            path = f"{field}[{i}].pieces[{j}]"
            if piece.tensor >= len(names):
                raise InvalidArgument(
                    f"{path}.tensor: index {piece.tensor} but the plan has {len(names)} specs",
                    field=f"{path}.tensor",
                )
            name = names[piece.tensor]
            pieces.append(Piece(name, box_from_proto(piece.box, field=f"{path}.box", tensor=name)))
        out.append(Link(src=link.src, dst=link.dst, pieces=tuple(pieces), nbytes=link.nbytes))
    return tuple(out)


def rank_plan_from_proto(msg: cpb.RankPlan, *, field: str = "plan") -> RankPlan:
    specs = [spec_from_proto(s, field=f"{field}.specs[{i}]") for i, s in enumerate(msg.specs)]
    names = [s.name for s in specs]
    return RankPlan(
        rank=msg.rank,
        specs={s.name: s for s in specs},
        sends=_links_from_proto(list(msg.sends), names, f"{field}.sends"),
        recvs=_links_from_proto(list(msg.recvs), names, f"{field}.recvs"),
        plan_digest=msg.plan_digest,
    )


def config_to_proto(config: TransferConfig) -> cpb.TransferConfig:
    return cpb.TransferConfig(
        bucket_bytes=config.bucket_bytes,
        num_channels=config.num_channels,
        max_inflight_bytes=config.max_inflight_bytes,
        timeout_s=config.timeout_s,
        verify_checksums=config.verify_checksums,
        direct_min_bytes=config.direct_min_bytes,
        delta=config.delta,
        delta_max_changed=config.delta_max_changed,
    )


def config_from_proto(msg: cpb.TransferConfig) -> TransferConfig:
    return TransferConfig(
        bucket_bytes=msg.bucket_bytes,
        num_channels=msg.num_channels,
        max_inflight_bytes=msg.max_inflight_bytes,
        timeout_s=msg.timeout_s,
        verify_checksums=msg.verify_checksums,
        # 0: a coordinator that predates the field; use the default.
        direct_min_bytes=msg.direct_min_bytes or DIRECT_MIN_BYTES,
        delta=msg.delta or "off",
        delta_max_changed=msg.delta_max_changed if msg.delta else DELTA_MAX_CHANGED,
    )
