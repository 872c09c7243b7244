"""The record a CUDA IPC sender hands its receiver for one message, and its checks.

One record per send: which CUDA allocation holds the bytes (torch's `_share_cuda_` of the
buffer's storage: the allocation's IPC handle, the storage's offset in it, the producer's
reference counter and event), where the message starts in the storage, how many bytes, the
sender's GPU (by UUID: device indices differ between processes) and a sequence number per
(channel, sender, receiver), so that a record that is not the one the receiver expects is
refused by name instead of copied. A storage is shared with a receiver once per group
(`fresh`: this record carries that share, which the receiver opens and holds until the
group ends); later records name the same share, so a refit adds no reference counters,
events or mappings (torch's sharing wraps the storage anew on every share). Small messages
(`INLINE_MAX_BYTES`: checksum vectors, whose buffers are new every refit) travel inline
instead, their bytes in a Gloo message after the record (`inline`), so no one-off buffer is
ever shared. Records have a fixed size (`RECORD_BYTES`): Gloo
receives need the length up front. No pickle: a peer's record is parsed, never executed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from refitplane.errors import TransferError

RECORD_BYTES = 512
# Messages up to this size go inline (over Gloo, through host memory) instead of shared.
INLINE_MAX_BYTES = 1 << 20
_MAGIC = b"RIPC"
# magic, seq, nbytes, tensor offset (bytes in the storage), storage size, storage offset
# (bytes in the allocation), ref counter offset, event sync required, fresh, inline.
_HEAD = struct.Struct("<4sQQQQQQ???")
_LEN = struct.Struct("<H")
_NONE = 0xFFFF
ACK = struct.Struct("<Q")


@dataclass(frozen=True)
class IpcRecord:
    seq: int
    nbytes: int
    # Where the message starts in the shared storage, in bytes.
    offset: int
    storage_size: int
    storage_offset: int
    ref_counter_offset: int
    event_sync_required: bool
    handle: bytes
    ref_counter_handle: bytes
    event_handle: bytes | None
    # The sender's GPU (torch.cuda.get_device_properties(i).uuid as text).
    device_uuid: str
    # The first record of this storage to this receiver in this group (a new share).
    fresh: bool = True
    # The bytes follow in a Gloo message (a small message; no share: handles empty).
    inline: bool = False

    @staticmethod
    def inline_message(seq: int, nbytes: int, device_uuid: str) -> IpcRecord:
        return IpcRecord(
            seq=seq,
            nbytes=nbytes,
            offset=0,
            storage_size=nbytes,
            storage_offset=0,
            ref_counter_offset=0,
            event_sync_required=False,
            handle=b"",
            ref_counter_handle=b"",
            event_handle=None,
            device_uuid=device_uuid,
            fresh=False,
            inline=True,
        )

    def encode(self) -> bytes:
        head = _HEAD.pack(
            _MAGIC,
            self.seq,
            self.nbytes,
            self.offset,
            self.storage_size,
            self.storage_offset,
            self.ref_counter_offset,
            self.event_sync_required,
            self.fresh,
            self.inline,
        )
        parts = [head]
        for blob in (
            self.handle,
            self.ref_counter_handle,
            self.event_handle,
            self.device_uuid.encode(),
        ):
            if blob is None:
                parts.append(_LEN.pack(_NONE))
            else:
                parts += [_LEN.pack(len(blob)), blob]
        out = b"".join(parts)
        if len(out) > RECORD_BYTES:
            raise TransferError(
                f"CUDA IPC record of message {self.seq} is {len(out)} bytes, above {RECORD_BYTES}"
            )
        return out.ljust(RECORD_BYTES, b"\0")

    @staticmethod
    def decode(data: bytes, *, where: str) -> IpcRecord:
        """Parse a record; `where` names the link and message in errors."""
        if len(data) != RECORD_BYTES or data[:4] != _MAGIC:
            raise TransferError(f"{where}: not a CUDA IPC record (bad magic or length)")
        head = _HEAD.unpack_from(data)[1:]
        seq, nbytes, offset, size, storage_offset, rc_offset, sync, fresh, inline = head
        pos = _HEAD.size
        blobs: list[bytes | None] = []
        for _ in range(4):
            if pos + _LEN.size > len(data):
                raise TransferError(f"{where}: truncated CUDA IPC record")
            (n,) = _LEN.unpack_from(data, pos)
            pos += _LEN.size
            if n == _NONE:
                blobs.append(None)
                continue
            if pos + n > len(data):
                raise TransferError(f"{where}: truncated CUDA IPC record")
            blobs.append(bytes(data[pos : pos + n]))
            pos += n
        handle, ref_counter, event, uuid = blobs
        if handle is None or ref_counter is None or uuid is None or (not handle and not inline):
            raise TransferError(f"{where}: CUDA IPC record without a memory handle")
        if offset + nbytes > size:
            raise TransferError(
                f"{where}: CUDA IPC record points past its storage ({offset} + {nbytes} > {size})"
            )
        return IpcRecord(
            seq=seq,
            nbytes=nbytes,
            offset=offset,
            storage_size=size,
            storage_offset=storage_offset,
            ref_counter_offset=rc_offset,
            event_sync_required=bool(sync),
            handle=handle,
            ref_counter_handle=ref_counter,
            event_handle=event,
            device_uuid=uuid.decode(errors="replace"),
            fresh=bool(fresh),
            inline=bool(inline),
        )

    def check(self, *, seq: int, nbytes: int, where: str) -> None:
        """The record is the message the receiver posted: same order, same size."""
        if self.seq != seq:
            raise TransferError(
                f"{where}: got the sender's message {self.seq}, expected {seq} (the two ranks "
                "disagree on the order of the link's messages)"
            )
        if self.nbytes != nbytes:
            raise TransferError(
                f"{where}: the sender's buffer is {self.nbytes} bytes, the receiver's {nbytes}"
            )
