"""A CUDA IPC link's chunks on each end, and the receiver's copies out of the sender's memory.

Both ends list a link's chunks in the order the plan gives them (`Chunk.index`), each with
its local memory: contiguous bytes, or a typed strided view where the box is not one span
of its tensor (a resharded box). The sender describes where each chunk lies in its
storages (`chunk_source`, a manifest row); the receiver rebuilds those views in the
storages it opened and plans the copies once (`ReceiverCopies`, kept while the sender's
manifest stays the same): contiguous chunks of one device through the kernel that
checksums as it copies (`copy_sums.py`, one launch), the rest by `copy_` (chunks that
continue each other on both ends merged; large ones alone, the copy engines; small ones in
one `_foreach_copy_`; strided boxes through typed views), their checksums after them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from refitplane.errors import TransferError
from refitplane.reshard import copy_sums
from refitplane.reshard.boxes import box_shape, format_box
from refitplane.reshard.checksum import PreparedSums, accumulate_sums_many
from refitplane.reshard.copy_sums import CopySums
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.message_io import MessageIO
from refitplane.reshard.schedule import Chunk, Message
from refitplane.reshard.shards import torch_dtype
from refitplane.reshard.transport.ipc_manifest import ChunkSource, IpcManifest

# Contiguous chunks at least this large are copied one `copy_` each (the copy engines, at
# full bandwidth); smaller ones together in one `_foreach_copy_` (one launch for hundreds).
ALONE_BYTES = 1 << 20


@dataclass(frozen=True)
class LocalChunk:
    """A chunk of a link and its memory on this rank: contiguous bytes (1-D uint8) or a
    typed strided view (a resharded box)."""

    chunk: Chunk
    view: torch.Tensor

    @property
    def contiguous(self) -> bool:
        return self.view.dtype == torch.uint8 and self.view.dim() == 1

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.contiguous:
            return self.view
        return self.view.view(dtype).view(box_shape(self.chunk.box))


def local_chunks(m: Message, io: MessageIO) -> list[LocalChunk]:
    """Every chunk of `m` with its local memory, from the views resolved for messages."""
    if io.direct is not None:
        return [LocalChunk(c, io.direct[c.offset : c.offset + c.nbytes]) for c in m.chunks]
    flat = dict(zip(io.flat, io.flat_views, strict=True))
    strided = {s.index: s.view for s in io.strided}
    return [LocalChunk(c, flat[i] if i in flat else strided[i]) for i, c in enumerate(m.chunks)]


def link_chunks(
    steps: Sequence[Sequence[tuple[Message, MessageIO | None]]], rank: int
) -> tuple[dict[int, list[LocalChunk]], dict[int, list[LocalChunk]]]:
    """This rank's chunks per outgoing link (by receiver) and per incoming link (by sender),
    each in the link's chunk order (`Chunk.index`: the same on both ends)."""
    sends: dict[int, list[LocalChunk]] = {}
    recvs: dict[int, list[LocalChunk]] = {}
    for step in steps:
        for m, io in step:
            if io is None:
                raise TransferError(
                    f"rank {rank}: message {m.round} from rank {m.src} to rank {m.dst} has no "
                    "memory (a staged receiver takes messages, not link copies)"
                )
            out = sends.setdefault(m.dst, []) if m.src == rank else recvs.setdefault(m.src, [])
            out.extend(local_chunks(m, io))
    for chunks in (*sends.values(), *recvs.values()):
        chunks.sort(key=lambda lc: lc.chunk.index)
    return sends, recvs


def chunk_source(view: torch.Tensor, storage: int) -> ChunkSource:
    """Where `view` lies in its storage, as a manifest row."""
    offset = view.data_ptr() - view.untyped_storage().data_ptr()
    nbytes = view.numel() * view.element_size()
    if view.dtype == torch.uint8 and view.dim() == 1 and view.is_contiguous():
        return ChunkSource(storage, offset, nbytes)
    return ChunkSource(
        storage, offset, nbytes, tuple(view.shape), tuple(view.stride()), view.element_size()
    )


class ChunkSums:
    """Every chunk's (S0, S1) into its row, for chunks and rows whose memory stays the same
    from one refit to the next: contiguous chunks in one launch over a table built once
    (`PreparedSums`), strided ones through contiguous copies, a batch of at most `budget`
    bytes at a time."""

    def __init__(
        self, chunks: Sequence[LocalChunk], rows: Sequence[torch.Tensor], budget: int
    ) -> None:
        flat = [(lc.view, rows[i]) for i, lc in enumerate(chunks) if lc.contiguous]
        self._flat = PreparedSums([b for b, _ in flat], [r for _, r in flat]) if flat else None
        self._strided = [(lc.view, rows[i]) for i, lc in enumerate(chunks) if not lc.contiguous]
        self._budget = budget

    def launch(self) -> None:
        """Add the sums (asynchronous on CUDA, on the current stream)."""
        if self._flat is not None:
            self._flat.launch()
        batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        held = 0
        for view, row in self._strided:
            copy = view.contiguous().view(-1).view(torch.uint8)
            batch.append((copy, row))
            held += copy.numel()
            if held >= self._budget:
                accumulate_sums_many([b for b, _ in batch], [r for _, r in batch])
                batch, held = [], 0
        if batch:
            accumulate_sums_many([b for b, _ in batch], [r for _, r in batch])


def _joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The bytes of `first` and of `second`, which follows it in the same storage."""
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    return out.set_(
        first.untyped_storage(), first.storage_offset(), (first.numel() + second.numel(),), (1,)
    )


def _merge(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive (dst, src) byte pairs that continue each other on both ends (same
    storages, back to back) as one pair: a message's fused run copies in one go."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if out:
            pd, ps = out[-1]
            if (
                pd.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
                and ps.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                and pd.data_ptr() + pd.numel() == dst.data_ptr()
                and ps.data_ptr() + ps.numel() == src.data_ptr()
                and pd.device == dst.device
                and ps.device == src.device
            ):
                out[-1] = (_joined(pd, dst), _joined(ps, src))
                continue
        out.append((dst, src))
    return out


def source_view(
    source: ChunkSource, storage: torch.Tensor, chunk: Chunk, dtype: torch.dtype, where: str
) -> torch.Tensor:
    """The chunk's memory in the sender's `storage` (a uint8 tensor of the whole storage):
    its bytes, or its strided view typed as `dtype`."""
    if source.contiguous:
        return storage[source.offset : source.offset + source.nbytes]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if itemsize != source.element_size or source.offset % itemsize:
        raise TransferError(
            f"{where}: chunk {chunk.tensor!r} {format_box(chunk.box)} is "
            f"{source.element_size}-byte elements at byte {source.offset} on the sender, "
            f"{dtype} here"
        )
    view = torch.empty(0, dtype=dtype, device=storage.device)
    return view.set_(
        storage.untyped_storage(), source.offset // itemsize, source.shape, source.stride
    )


@dataclass
class ReceiverCopies:
    """A receiver's copies of one link, built from the sender's manifest."""

    chunks: list[LocalChunk]
    # The kernel's launch (chunks it copies and checksums), and the checksums of the other
    # chunks, after their copies.
    fused: CopySums | None = None
    after: ChunkSums | None = None
    # Contiguous copies: large ones alone, small ones in one `_foreach_copy_`; typed ones.
    alone: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    small_dst: list[torch.Tensor] = field(default_factory=list)
    small_src: list[torch.Tensor] = field(default_factory=list)
    typed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # One (S0, S1) row per chunk (None: checksums off).
    sums: torch.Tensor | None = None
    fuse: bool = False

    @staticmethod
    def build(
        chunks: list[LocalChunk],
        manifest: IpcManifest,
        storages: Sequence[torch.Tensor],
        specs: Mapping[str, TensorSpec],
        where: str,
        *,
        verify: bool,
        fuse: bool,
        device: torch.device,
        budget: int,
    ) -> ReceiverCopies:
        """`storages`: the manifest's storages as opened here (uint8, whole); `budget`: bytes
        of contiguous copies of strided chunks that their checksums may hold at once."""
        out = ReceiverCopies(chunks, fuse=fuse)
        if verify:
            out.sums = torch.zeros((len(chunks), 2), dtype=torch.int64, device=device)
        flat: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for index, (lc, source) in enumerate(zip(chunks, manifest.chunks, strict=True)):
            dtype = torch_dtype(specs[lc.chunk.tensor].dtype)
            src = source_view(source, storages[source.storage], lc.chunk, dtype, where)
            if lc.contiguous and source.contiguous:
                flat.append((index, lc.view, src))
            else:
                shape = box_shape(lc.chunk.box)
                src_t = src if not source.contiguous else src.view(dtype).view(shape)
                out.typed.append((lc.typed(dtype), src_t))
        fused = [
            f for f in flat if fuse and out.sums is not None and copy_sums.eligible(f[1], f[2])
        ]
        if fused and out.sums is not None:
            rows = out.sums.unbind(0)
            out.fused = CopySums([(d, s) for _, d, s in fused], [rows[i] for i, _, _ in fused])
        taken = {i for i, _, _ in fused}
        rest = [i for i in range(len(chunks)) if i not in taken]
        if rest and out.sums is not None:
            rows = out.sums.unbind(0)
            out.after = ChunkSums([chunks[i] for i in rest], [rows[i] for i in rest], budget)
        merged = _merge([(d, s) for i, d, s in flat if i not in taken])
        out.alone = [(d, s) for d, s in merged if d.numel() >= ALONE_BYTES or d.device != s.device]
        small = [(d, s) for d, s in merged if d.numel() < ALONE_BYTES and d.device == s.device]
        out.small_dst = [d for d, _ in small]
        out.small_src = [s for _, s in small]
        return out

    def launch(self) -> None:
        """Every copy, then the checksums the copies did not add, on the current stream
        (asynchronous on CUDA)."""
        if self.sums is not None:
            self.sums.zero_()
        if self.fused is not None:
            self.fused.launch()
        for dst, src in self.alone:
            dst.copy_(src, non_blocking=True)
        if self.small_dst:
            torch._foreach_copy_(self.small_dst, self.small_src, non_blocking=True)
        for dst, src in self.typed:
            dst.copy_(src, non_blocking=True)
        if self.after is not None:
            self.after.launch()
