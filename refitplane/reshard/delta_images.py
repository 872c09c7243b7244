"""A sender's delta base, message by message, and the images its scan reads.

The scan compares each delta message's current bytes with the same boxes of the base (the
snapshot): a direct message's memory on both sides, or, for a staged message, its chunks
packed into one zeroed arena (alignment gaps zero in both images, as in the staging slices
of both ends). What the base looks like per message (`BaseViews`: its views, the tensors the
delta messages leave unsent, and on CUDA one chunk table packing every staged image and one
unpacking the current images into the base for the advance) is resolved once and kept
while the base registry lives and the plan's messages stay the same: resolving hundreds of
views, or packing message by message, costs milliseconds every refit.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from refitplane.reshard.boxes import box_numel, pairwise_disjoint
from refitplane.reshard.chunk_copy import ChunkTable, build_tables, eligible
from refitplane.reshard.chunk_copy import launch as launch_copy
from refitplane.reshard.delta import word_size
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.message_io import MessageIO, message_io, with_copy_tables
from refitplane.reshard.schedule import Message
from refitplane.reshard.shards import LocalShards

# (src, dst, round): a message's identity within one refit.
MessageKey = tuple[int, int, int]
# (message, current image, base image, word size) for the scan.
Scanned = tuple[Message, torch.Tensor, torch.Tensor, int]


@dataclass(frozen=True)
class ImageTables:
    offsets: dict[tuple[int, bool], int]  # (message index, is base) -> offset in the arena
    nbytes: int
    pack: ChunkTable
    advance: ChunkTable


@dataclass
class BaseViews:
    """A sender's base resolved message by message (with copy tables on CUDA) and the tensors
    its delta messages do not send (`unsent_tensors`): resolving hundreds of views costs
    milliseconds every refit. Kept in `_BASE_VIEWS` while the base registry lives (the
    snapshot's memory goes with it) and its messages are the same objects (a plan's schedule
    is kept while the plan stays the same)."""

    version: int
    messages: dict[MessageKey, Message]
    ios: dict[MessageKey, MessageIO]
    unsent: list[str] | None
    # On CUDA, where every staged chunk (current and base) is flat and aligned: one chunk
    # table packing all staged images into the encoding's arena at fixed offsets, and one
    # unpacking the current images into the base (the advance); one launch each, not one
    # per message.
    images: ImageTables | None = None


_BASE_VIEWS: weakref.WeakKeyDictionary[LocalShards, BaseViews] = weakref.WeakKeyDictionary()


def pack_image(io: MessageIO, out: torch.Tensor) -> torch.Tensor:
    """A message's bytes as they travel (its chunks at their offsets, gaps as `out` holds
    them) in `out`; a direct message's memory is its image already."""
    if io.direct is not None:
        return io.direct
    if io.copy is not None:  # one launch over the message's chunk table
        launch_copy(io.copy, out, scatter=False)
        return out
    parts = io.parts(out)
    for index, view in zip(io.flat, io.flat_views, strict=True):
        parts[index].copy_(view)
    for chunk in io.strided:
        chunk.typed(parts[chunk.index]).copy_(chunk.view)
    return out


def unpack_image(io: MessageIO, image: torch.Tensor) -> None:
    """`pack_image` backwards: the message's bytes in `image` into `io`'s views."""
    if io.direct is not None:
        io.direct.copy_(image)
        return
    if io.copy is not None:
        launch_copy(io.copy, image, scatter=True)
        return
    parts = io.parts(image)
    for index, view in zip(io.flat, io.flat_views, strict=True):
        view.copy_(parts[index])
    for chunk in io.strided:
        chunk.view.copy_(chunk.typed(parts[chunk.index]))


def unsent_tensors(messages: Iterable[Message], base: LocalShards) -> list[str] | None:
    """Whether advancing the base message by message leaves it holding exactly the version
    sent: every element `messages` send is sent once and every tensor is sent whole or not
    at all (one target replica fed from this rank's shards). Returns the tensors they do
    not send (a replicated norm another rank sends; copied whole instead), or None when an
    element goes twice (two replicas, a norm replicated on the receivers) or a tensor only
    in part."""
    held: dict[str, int] = {}
    for sv in base:
        held[sv.spec.name] = held.get(sv.spec.name, 0) + box_numel(sv.box)
    sent: dict[str, list[tuple[tuple[int, int], ...]]] = {}
    for m in messages:
        for c in m.chunks:
            sent.setdefault(c.tensor, []).append(c.box)
    for name, boxes in sent.items():
        if sum(box_numel(b) for b in boxes) != held.get(name) or not pairwise_disjoint(boxes):
            return None
    return [name for name in held if name not in sent]


def word_of(m: Message, specs: Mapping[str, TensorSpec]) -> int:
    return word_size(specs[c.tensor].itemsize for c in m.chunks)


def base_views(
    base: LocalShards,
    delta_sends: list[tuple[Message, MessageIO]],
    specs: Mapping[str, TensorSpec],
) -> BaseViews:
    """The base's views of every delta message: kept from an earlier transfer of these
    messages against this base registry, else resolved now and kept."""
    kept = _BASE_VIEWS.get(base)
    if (
        kept is not None
        and kept.version == base.version
        and all(kept.messages.get((m.src, m.dst, m.round)) is m for m, _ in delta_sends)
    ):
        return kept
    step = tuple(
        (m, message_io(m, [base.view(c.tensor, c.box) for c in m.chunks], specs))
        for m, _ in delta_sends
    )
    base_device = next(iter(base)).tensor.device
    (resolved,) = with_copy_tables((step,), base_device)
    ios = {(m.src, m.dst, m.round): io for m, io in resolved if io is not None}
    unsent = unsent_tensors((m for m, _ in delta_sends), base)
    messages = {(m.src, m.dst, m.round): m for m, _ in delta_sends}
    _BASE_VIEWS[base] = views = BaseViews(base.version, messages, ios, unsent)
    return views


def images(
    views: BaseViews,
    delta_sends: list[tuple[Message, MessageIO]],
    base_device: torch.device,
    device: torch.device,
    specs: Mapping[str, TensorSpec],
) -> tuple[list[Scanned], torch.Tensor | None]:
    """(message, current image, base image, word) for every delta message — a direct
    message's memory, a staged one's chunks packed into one zeroed arena (alignment gaps
    zero in both images, as in the staging slices of both ends: the executor zeroes a
    staged delta message's slice before packing), each at a multiple of 16 bytes — and the
    arena when one launch packed it (`ImageTables`)."""
    base_ios = [views.ios[(m.src, m.dst, m.round)] for m, _ in delta_sends]
    tables = _image_tables(views, delta_sends, base_ios, base_device, device)
    if tables is not None:
        arena = torch.zeros(tables.nbytes, dtype=torch.uint8, device=device)
        launch_copy(tables.pack, arena, scatter=False)
        scanned: list[Scanned] = []
        for i, ((m, io), base_io) in enumerate(zip(delta_sends, base_ios, strict=True)):
            current, old = io.direct, base_io.direct
            if current is None:
                at = tables.offsets[(i, False)]
                current = arena[at : at + m.nbytes]
            if old is None:
                at = tables.offsets[(i, True)]
                old = arena[at : at + m.nbytes]
            scanned.append((m, current, old, word_of(m, specs)))
        return scanned, arena
    staged: list[tuple[int, MessageIO, Message]] = []
    total = 0
    for i, ((m, io), base_io) in enumerate(zip(delta_sends, base_ios, strict=True)):
        for one in (io, base_io):
            if one.direct is None:
                staged.append((i, one, m))
                total += (m.nbytes + 15) // 16 * 16
    arena = torch.zeros(total, dtype=torch.uint8, device=device)
    packed: dict[tuple[int, int], torch.Tensor] = {}
    at = 0
    for i, one, m in staged:
        out = arena[at : at + m.nbytes]
        at += (m.nbytes + 15) // 16 * 16
        if one.direct is None and base_device != device and one is base_ios[i]:
            # A host-side snapshot: packed on the host, then copied over.
            host = torch.zeros(m.nbytes, dtype=torch.uint8, device=base_device)
            out.copy_(pack_image(one, host))
        else:
            pack_image(one, out)
        packed[(i, id(one))] = out
    todo: list[Scanned] = []
    for i, ((m, io), base_io) in enumerate(zip(delta_sends, base_ios, strict=True)):
        current = io.direct if io.direct is not None else packed[(i, id(io))]
        old = base_io.direct if base_io.direct is not None else packed[(i, id(base_io))]
        if old.device != current.device:  # a direct message of a host-side snapshot
            old = old.to(current.device)
        todo.append((m, current, old, word_of(m, specs)))
    return todo, None


def _image_tables(
    views: BaseViews,
    delta_sends: list[tuple[Message, MessageIO]],
    base_ios: list[MessageIO],
    base_device: torch.device,
    device: torch.device,
) -> ImageTables | None:
    """The staged images' chunk tables (`ImageTables`), made once per base registry and
    messages; None where a staged chunk is strided or unaligned, the snapshot is on the
    host, or not on CUDA."""
    if base_device != device:
        return None
    if views.images is not None:
        return views.images
    offsets: dict[tuple[int, bool], int] = {}
    pack: list[tuple[torch.Tensor, int]] = []
    advance: list[tuple[torch.Tensor, int]] = []
    total = 0
    for i, ((m, io), base_io) in enumerate(zip(delta_sends, base_ios, strict=True)):
        for is_base, one in ((False, io), (True, base_io)):
            if one.direct is not None:
                continue
            if one.strided or not eligible(one.flat_views):
                return None
            offsets[(i, is_base)] = total
            total += (m.nbytes + 15) // 16 * 16
            pack += [
                (view, offsets[(i, is_base)] + m.chunks[k].offset)
                for k, view in zip(one.flat, one.flat_views, strict=True)
            ]
        if base_io.direct is None:
            # The advance writes the current image's bytes into the base's views.
            at = offsets[(i, False)] if io.direct is None else -1
            if at < 0:
                return None  # (a direct current with a staged base: not a layout we make)
            advance += [
                (view, at + m.chunks[k].offset)
                for k, view in zip(base_io.flat, base_io.flat_views, strict=True)
            ]
    if not pack:
        return None
    pack_table, advance_table = build_tables(
        [
            ([v for v, _ in pack], [o for _, o in pack]),
            ([v for v, _ in advance], [o for _, o in advance]),
        ],
        device,
    )
    views.images = ImageTables(offsets, total, pack_table, advance_table)
    return views.images


def advance(
    views: BaseViews,
    arena: torch.Tensor | None,
    scanned: list[Scanned],
    base_ios: list[MessageIO],
) -> None:
    """After a scan that wrote the changed words into the base images: the staged ones are
    copies (in `arena`), so their bytes go into the base's views (one launch on CUDA)."""
    if arena is not None and views.images is not None:
        launch_copy(views.images.advance, arena, scatter=True)
        return
    for (_, current, _, _), base_io in zip(scanned, base_ios, strict=True):
        if base_io.direct is None:
            unpack_image(base_io, current)
