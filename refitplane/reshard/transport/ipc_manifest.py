"""What a CUDA IPC sender hands a receiver once per refit: where every chunk of the link lies
in the sender's memory (`IpcManifest`), so that the receiver copies the whole link itself.

A manifest holds the link's storages (one `IpcRecord` each: the allocation's CUDA IPC
share, as torch's `_share_cuda_` gives it, shared once per receiver while the group lives)
and one row per chunk of the link, in the link's chunk order (`Chunk.index`, which both
ends derive from the same plan): the storage, the byte offset of the chunk's first element
in it, its bytes, and for a chunk whose memory is not one contiguous span its shape and
strides in elements (a resharded box of a larger tensor), so the receiver rebuilds the
exact view. The bytes are a fixed header, the storage records and an int64 row table: no
pickle, a peer's manifest is parsed and checked, never executed. A manifest whose bytes
equal the last one of its link names the same memory (the sender shares each storage once
and keeps it referenced): the receiver reuses the views it built from it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refitplane.errors import TransferError
from refitplane.reshard.transport.ipc_records import RECORD_BYTES, IpcRecord

MAX_DIMS = 6
# storage, byte offset, bytes, dims (0: one contiguous span), element size, shape, strides.
ROW_WORDS = 5 + 2 * MAX_DIMS
_MAGIC = b"RIPM"
# magic, generation, storages, chunks.
_HEAD = struct.Struct("<4sQII")
# A completion: magic, status (`DONE_*`).
COMPLETION = struct.Struct("<4sI")
_DONE_MAGIC = b"RIPD"
DONE_OK = 0
DONE_MISMATCH = 1
DONE_FAILED = 2


@dataclass(frozen=True)
class ChunkSource:
    """One chunk's memory on the sender."""

    storage: int
    # Bytes from the storage's start to the chunk's first element.
    offset: int
    nbytes: int
    # Empty: the chunk is `nbytes` contiguous bytes. Else the strided view's shape and
    # strides, in elements of `element_size` bytes.
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    element_size: int = 1

    @property
    def contiguous(self) -> bool:
        return not self.shape

    def extent(self) -> int:
        """Bytes from `offset` to one past the chunk's last byte in the storage."""
        if self.contiguous:
            return self.nbytes
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.element_size


# The most bytes a manifest may take (~400k chunks a link), the same for every link: a
# receiver posts one receive of this size (host memory that only the message's bytes touch)
# and the manifest's header says where it ends (`manifest_in`), so no length message goes
# first (one control round trip fewer before the copies); a sender never sends more
# (`check_manifest_size`). Gloo aborts a process that receives more than it posted, so the
# bound must not depend on what either end believes the link holds.
MANIFEST_LIMIT = 256 << 20


def _encoded_size(n_storages: int, n_chunks: int) -> int:
    """A manifest's bytes, from its header's counts."""
    return _HEAD.size + n_storages * RECORD_BYTES + n_chunks * ROW_WORDS * 8


def check_manifest_size(data: bytes, *, where: str) -> None:
    if len(data) > MANIFEST_LIMIT:
        raise TransferError(
            f"{where}: CUDA IPC manifest of {len(data)} bytes, more than the protocol's "
            f"{MANIFEST_LIMIT} (too many chunks in one link)"
        )


def manifest_in(buffer: memoryview, *, where: str) -> bytes:
    """The manifest at the start of `buffer` (a receive of `MANIFEST_LIMIT` bytes), its
    length read from its own header; `IpcManifest.decode` checks the rest."""
    if len(buffer) < _HEAD.size or bytes(buffer[:4]) != _MAGIC:
        raise TransferError(f"{where}: not a CUDA IPC manifest (bad magic or length)")
    _, _, n_storages, n_chunks = _HEAD.unpack_from(buffer)
    size = _encoded_size(n_storages, n_chunks)
    if size > len(buffer):
        raise TransferError(
            f"{where}: CUDA IPC manifest header says {size} bytes, more than the "
            f"{len(buffer)} received ({n_storages} storages, {n_chunks} chunks)"
        )
    return bytes(buffer[:size])


@dataclass(frozen=True)
class IpcManifest:
    # Bumped by the sender whenever the memory behind its chunks changed (new shares).
    generation: int
    storages: tuple[IpcRecord, ...]
    chunks: tuple[ChunkSource, ...]

    def encode(self) -> bytes:
        rows = np.zeros((len(self.chunks), ROW_WORDS), dtype=np.int64)
        for i, c in enumerate(self.chunks):
            if len(c.shape) > MAX_DIMS:
                raise TransferError(
                    f"CUDA IPC chunk {i} has {len(c.shape)} dimensions, above {MAX_DIMS}"
                )
            rows[i, :5] = (c.storage, c.offset, c.nbytes, len(c.shape), c.element_size)
            rows[i, 5 : 5 + len(c.shape)] = c.shape
            rows[i, 5 + MAX_DIMS : 5 + MAX_DIMS + len(c.stride)] = c.stride
        head = _HEAD.pack(_MAGIC, self.generation, len(self.storages), len(self.chunks))
        return head + b"".join(r.encode() for r in self.storages) + rows.tobytes()

    @staticmethod
    def decode(data: bytes, *, where: str) -> IpcManifest:
        """Parse and check a manifest; `where` names the link in errors."""
        if len(data) < _HEAD.size or data[:4] != _MAGIC:
            raise TransferError(f"{where}: not a CUDA IPC manifest (bad magic or length)")
        _, generation, n_storages, n_chunks = _HEAD.unpack_from(data)
        expected = _encoded_size(n_storages, n_chunks)
        if len(data) != expected:
            raise TransferError(
                f"{where}: CUDA IPC manifest is {len(data)} bytes, its header says {expected}"
            )
        pos = _HEAD.size
        storages = []
        for i in range(n_storages):
            record = IpcRecord.decode(data[pos : pos + RECORD_BYTES], where=f"{where}, storage {i}")
            storages.append(record)
            pos += RECORD_BYTES
        rows = np.frombuffer(data, dtype=np.int64, offset=pos).reshape(n_chunks, ROW_WORDS)
        chunks = []
        for i, row in enumerate(rows.tolist()):
            storage, offset, nbytes, ndim, element_size = row[:5]
            if not 0 <= storage < n_storages or not 0 <= ndim <= MAX_DIMS or element_size < 1:
                raise TransferError(f"{where}: CUDA IPC manifest row {i} is malformed: {row[:5]}")
            shape = tuple(row[5 : 5 + ndim])
            stride = tuple(row[5 + MAX_DIMS : 5 + MAX_DIMS + ndim])
            chunk = ChunkSource(storage, offset, nbytes, shape, stride, element_size)
            size = storages[storage].storage_size
            if offset < 0 or nbytes < 0 or min(stride, default=0) < 0:
                raise TransferError(f"{where}: CUDA IPC manifest row {i} has a negative field")
            if offset + chunk.extent() > size:
                raise TransferError(
                    f"{where}: CUDA IPC chunk {i} points past its storage ({offset} + "
                    f"{chunk.extent()} > {size})"
                )
            if shape and int(np.prod(shape)) * element_size != nbytes:
                raise TransferError(
                    f"{where}: CUDA IPC chunk {i}: shape {list(shape)} of {element_size}-byte "
                    f"elements is not {nbytes} bytes"
                )
            chunks.append(chunk)
        return IpcManifest(generation, tuple(storages), tuple(chunks))

    def check_sizes(self, nbytes: Sequence[int], *, where: str, names: Sequence[str]) -> None:
        """The manifest describes exactly the receiver's chunks: one row each, same bytes."""
        if len(self.chunks) != len(nbytes):
            raise TransferError(
                f"{where}: the sender describes {len(self.chunks)} chunk(s), this rank expects "
                f"{len(nbytes)} (the two ranks disagree on the plan)"
            )
        for i, (chunk, n) in enumerate(zip(self.chunks, nbytes, strict=True)):
            if chunk.nbytes != n:
                raise TransferError(
                    f"{where}: chunk {i} ({names[i]!r}) is {chunk.nbytes} bytes on the sender, "
                    f"{n} here"
                )


def encode_completion(status: int) -> bytes:
    return COMPLETION.pack(_DONE_MAGIC, status)


def decode_completion(data: bytes, *, where: str) -> int:
    magic, status = COMPLETION.unpack(data)
    if magic != _DONE_MAGIC or status not in (DONE_OK, DONE_MISMATCH, DONE_FAILED):
        raise TransferError(f"{where}: not a CUDA IPC completion")
    return int(status)
