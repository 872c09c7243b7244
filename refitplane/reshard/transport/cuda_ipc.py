"""CUDA IPC transport (GPUs of one node, or ranks sharing one GPU): the receiver maps the
sender's buffers and copies exactly its message out of them.

Control messages go over Gloo (CPU, TCP; rendezvous = a TCPStore "host:port", as the Gloo
transport's), the bytes never do: for each send the sender hands out a record of its
buffer (`ipc_records.IpcRecord`: the storage's CUDA IPC share, the offset and size of the
message, a sequence number); the receiver copies the message into its buffer on the
channel's copy stream (the copy engines: same GPU, or the peer GPU over NVLink/PCIe), and,
once the copy completed, sends an 8-byte acknowledgement with the sequence number. Each
storage (a parameter, the staging ring) is shared with a receiver once per group (torch's
`_share_cuda_`), opened by it once and held until the group ends, so steady refits add no
shares, events or mappings; the sender keeps what it shared referenced meanwhile, so its
memory is never freed or reused under a receiver's mapping. The sender's send completes with that acknowledgement, so its
staging slice (or the parameters a direct message reads) is not reused before the receiver
has its bytes. Buffers are the executor's: the trainer's bounded staging ring and its
parameters; nothing else is allocated per refit.

Ordering: a sender synchronizes its packing (on the host) before it hands out a record, so
the receiver's copy, queued after it reads the record, reads packed bytes. Unpacking and
checksums on the receiver are queued after the copy on a side stream (`device_ordered`),
as on NCCL. A receiver posting a group waits for each of its records (bounded by the
deadline) while it acknowledges every earlier copy that completed, so a sender waiting for
an acknowledgement to free its ring never waits on a receiver that waits on it.

Failures are `TransferError`s naming the rank, the peer, the channel and the message: a
record that is not the expected one (order, size), a handle that does not open (a sender
that exited or freed the memory), a GPU the receiver cannot see (CUDA_VISIBLE_DEVICES must
include the sender's GPU for a cross-GPU link), a timeout. The executor adds the tensors.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from refitplane.errors import InvalidArgument, PeerFailure, TransferError, TransferTimeout
from refitplane.reshard.transport.base import Handle, P2POp
from refitplane.reshard.transport.gloo import GlooTransport
from refitplane.reshard.transport.gloo_waits import GlooWaits, Pending
from refitplane.reshard.transport.ipc_records import (
    ACK,
    INLINE_MAX_BYTES,
    RECORD_BYTES,
    IpcRecord,
)
from refitplane.reshard.transport.streams import ChannelStreams, StreamedTransport

_TAG_RECORD = 1
_TAG_ACK = 2
_TAG_INLINE = 3
_MAX_POLL_S = 5e-5


def device_uuid(device: torch.device | int) -> str:
    """The GPU's UUID as text (the identity members register; stable across processes)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass
class _Incoming:
    """A receive whose copy is queued: acknowledged once `event` completed."""

    peer: int
    channel: int
    seq: int
    event: torch.cuda.Event
    acked: bool = False


@dataclass
class _State:
    """A posted group: its copy/side events, its acknowledgements to wait for (sender),
    and what must stay referenced until it completes."""

    events: list[torch.cuda.Event] = field(default_factory=list)
    acks: list[tuple[Pending, torch.Tensor, int, int]] = field(default_factory=list)
    # Sends (records, inline bytes): waited for once acknowledged (then surely done).
    sends: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)


class CudaIpcTransport(StreamedTransport):
    device_ordered = True
    copies_links = True

    def __init__(self, control: GlooTransport, *, device: torch.device) -> None:
        """`control`: the group's Gloo transport (its channels carry the records and
        acknowledgements); this transport owns it from now on."""
        if device.type != "cuda":
            control.abort()
            raise InvalidArgument(
                f"rank {control.rank}: CUDA IPC needs a CUDA device, got {device}", field="device"
            )
        torch.cuda.set_device(device)
        self._control = control
        self._pgs: list[Any] = control._groups
        self.rank = control.rank
        self.world_size = control.world_size
        self.num_channels = control.num_channels
        self.device = device
        self.timeout_s = control.timeout_s
        self._uuid = device_uuid(device)
        # Per channel: the copy stream (the transfer), a pack and a side stream.
        self._channels = ChannelStreams(device, self.num_channels)
        self._copy = self._channels.transfer
        self._pack = self._channels.pack
        self._send_seq: dict[tuple[int, int], int] = {}
        self._recv_seq: dict[tuple[int, int], int] = {}
        # Sender: each storage shared once per receiver, kept (and so never freed or reused
        # under the share) until the group ends: (peer, data pointer) → storage, share.
        self._shared: dict[tuple[int, int], tuple[torch.UntypedStorage, tuple[Any, ...]]] = {}
        self._share_count = 0
        # Receiver: allocations opened, by (handle, storage offset); local index by GPU UUID.
        self._opened: dict[tuple[bytes, int], torch.UntypedStorage] = {}
        self._local_index: dict[str, int] = {}
        self._incoming: deque[_Incoming] = deque()
        # Acknowledgements sent: (work, bytes), waited for (long done) once many piled up.
        self._ack_sends: deque[tuple[Any, torch.Tensor]] = deque()
        # Gloo operations complete only in wait(): receives are waited for on threads.
        self._waits = GlooWaits(name=f"ipc-r{self.rank}")
        self._aborted = False
        # Whether the group runs link copies (`link_copies`): agreed at its first transfer.
        self._link_copies: bool | None = None

    # -- transfers ----------------------------------------------------------------------------

    def _where(self, channel: int, src: int, dst: int, seq: int) -> str:
        return f"rank {self.rank}: CUDA IPC message {seq} from rank {src} to rank {dst} on channel {channel}"

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        if self._aborted:
            raise TransferError("transport was aborted; a new group is needed")
        self._check_buffers(ops, "CUDA IPC")
        pg = self._pgs[channel]
        state = _State()
        sends = [op for op in ops if op.send]
        if sends:
            # The records hand out packed bytes: packing (and, for direct messages, the
            # writes ordered before `begin`) must be done before a receiver copies.
            self._pack[channel].synchronize()
        try:
            for op in sends:
                key = (channel, op.peer)
                seq = self._send_seq.get(key, 0)
                self._send_seq[key] = seq + 1
                inline = op.buffer.numel() <= INLINE_MAX_BYTES
                if inline:
                    record = IpcRecord.inline_message(seq, op.buffer.numel(), self._uuid)
                else:
                    record = self._export(op.buffer, op.peer, seq, channel)
                out = torch.frombuffer(bytearray(record.encode()), dtype=torch.uint8)
                ack = torch.zeros(ACK.size, dtype=torch.uint8)
                state.keep += [out, op.buffer]
                state.sends.append(pg.send([out], op.peer, _TAG_RECORD))
                if inline:
                    host = op.buffer.cpu()  # packing is done (synchronized above)
                    state.keep.append(host)
                    state.sends.append(pg.send([host], op.peer, _TAG_INLINE))
                received = self._waits.submit(pg.recv([ack], op.peer, _TAG_ACK), deadline)
                state.acks.append((received, ack, op.peer, seq))
            recvs = [op for op in ops if not op.send]
            posted = []
            for op in recvs:
                rec = torch.empty(RECORD_BYTES, dtype=torch.uint8)
                work = pg.recv([rec], op.peer, _TAG_RECORD)
                posted.append((op, rec, self._waits.submit(work, deadline)))
            for op, rec, arrived in posted:
                key = (channel, op.peer)
                seq = self._recv_seq.get(key, 0)
                self._recv_seq[key] = seq + 1
                where = self._where(channel, op.peer, self.rank, seq)
                self._wait_work(arrived, deadline, where)
                record = IpcRecord.decode(rec.numpy().tobytes(), where=where)
                record.check(seq=seq, nbytes=op.buffer.numel(), where=where)
                if record.inline:
                    source = torch.empty(record.nbytes, dtype=torch.uint8)
                    inline_work = pg.recv([source], op.peer, _TAG_INLINE)
                    self._wait_work(self._waits.submit(inline_work, deadline), deadline, where)
                else:
                    source = self._open(record, where)
                with torch.cuda.stream(self._copy[channel]):
                    op.buffer.copy_(source, non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record()
                state.events.append(event)
                state.keep.append(source)
                self._incoming.append(_Incoming(op.peer, channel, seq, event))
        except RuntimeError as exc:
            raise PeerFailure(
                f"rank {self.rank}: CUDA IPC on channel {channel} failed: {exc}"
            ) from exc
        return Handle(channel, state)

    def _export(self, buf: torch.Tensor, peer: int, seq: int, channel: int) -> IpcRecord:
        record, fresh = self._share(buf.untyped_storage(), peer, channel)
        return replace(
            record,
            seq=seq,
            nbytes=buf.numel(),
            offset=int(buf.storage_offset()) * buf.element_size(),
            fresh=fresh,
        )

    def _share(
        self, storage: torch.UntypedStorage, peer: int, channel: int = 0
    ) -> tuple[IpcRecord, bool]:
        """The storage's share with `peer` (made once per group; True: made now), as a record
        of the whole storage."""
        key = (peer, storage.data_ptr())
        kept = self._shared.get(key)
        fresh = kept is None
        if kept is None:
            with torch.cuda.stream(self._pack[channel]):
                share = storage._share_cuda_()  # type: ignore[no-untyped-call]
            kept = (storage, tuple(share))
            self._shared[key] = kept
            self._share_count += 1
        _device, handle, size, storage_offset, ref_counter, rc_offset, event, sync = kept[1]
        record = IpcRecord(
            seq=0,
            nbytes=int(size),
            offset=0,
            storage_size=int(size),
            storage_offset=int(storage_offset),
            ref_counter_offset=int(rc_offset),
            event_sync_required=bool(sync),
            handle=bytes(handle),
            ref_counter_handle=bytes(ref_counter),
            event_handle=bytes(event) if event is not None else None,
            device_uuid=self._uuid,
            fresh=False,
        )
        return record, fresh

    def share_storage(self, storage: torch.UntypedStorage, peer: int, index: int) -> IpcRecord:
        """Link copies (`ipc_run`): a record of the whole `storage` for `peer` (`seq` = its
        index in the manifest). Shared once per group and kept referenced until it ends."""
        record, _ = self._share(storage, peer)
        return replace(record, seq=index)

    @property
    def shares(self) -> int:
        """How many shares this rank made in this group (a manifest's generation)."""
        return self._share_count

    def release_shares(self, peer: int, keep: Collection[int]) -> int:
        """Link copies: let go of the shares with `peer` of storages (by data pointer) not in
        `keep`, once `peer` completed a refit that no longer names them (it let go of its
        mappings when it read the new manifest): a trainer that reallocates its parameters
        (offloading them between steps) does not keep the old memory alive. torch frees the
        memory once the receiver's reference is gone too. Returns how many went."""
        stale = [key for key in self._shared if key[0] == peer and key[1] not in keep]
        for key in stale:
            del self._shared[key]
        return len(stale)

    def close_storages(self, records: Iterable[IpcRecord]) -> None:
        """Link copies: forget the opened storages `records` name (a sender's manifest no
        longer does); the mapping closes with the last view of it."""
        for record in records:
            self._opened.pop((record.handle, record.storage_offset), None)

    def _device_index(self, uuid: str, where: str) -> int:
        index = self._local_index.get(uuid)
        if index is None:
            for i in range(torch.cuda.device_count()):
                self._local_index.setdefault(device_uuid(i), i)
            index = self._local_index.get(uuid)
        if index is None:
            raise TransferError(
                f"{where}: the sender's GPU {uuid} is not visible here; a cross-GPU CUDA IPC "
                "link needs the receiver to see the sender's GPU (CUDA_VISIBLE_DEVICES)"
            )
        return index

    def _open(self, record: IpcRecord, where: str) -> torch.Tensor:
        """The message's bytes in the sender's memory, as a uint8 tensor of this process."""
        key = (record.handle, record.storage_offset)
        if key in self._opened and record.fresh:
            # A share of memory already open here: give its reference back at once.
            index = self._device_index(record.device_uuid, where)
            torch.UntypedStorage._release_ipc_counter(  # type: ignore[no-untyped-call]
                record.ref_counter_handle, record.ref_counter_offset, device=index
            )
        if key not in self._opened and not record.fresh:
            raise TransferError(
                f"{where}: the record names a share of the sender's memory this rank never "
                "opened (the two ranks disagree on the group's history)"
            )
        whole = self.open_storage(record, where)
        return whole[record.offset : record.offset + record.nbytes]

    def open_storage(self, record: IpcRecord, where: str) -> torch.Tensor:
        """The whole shared storage `record` names, as a uint8 tensor of this process: opened
        at its first use and held until the group ends (the share's reference then keeps
        the sender from freeing or reusing the memory)."""
        index = self._device_index(record.device_uuid, where)
        key = (record.handle, record.storage_offset)
        storage = self._opened.get(key)
        if storage is None:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    record.handle,
                    record.storage_size,
                    record.storage_offset,
                    record.ref_counter_handle,
                    record.ref_counter_offset,
                    record.event_handle,
                    record.event_sync_required,
                )
            except RuntimeError as exc:
                raise PeerFailure(
                    f"{where}: cannot open the sender's CUDA IPC handle (did it exit or free "
                    f"the memory?): {exc}"
                ) from exc
            self._opened[key] = storage
        whole = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        whole.set_(storage, 0, (record.storage_size,))  # type: ignore[call-overload]
        return whole

    # -- control messages of link copies (`ipc_run`) -----------------------------------------------

    def link_copies(self, mine: bool, deadline: float) -> bool:
        """Whether this group's refits run as link copies: every rank must be able to (a
        receiver that stages its weights takes messages, and so must every rank it links
        to, and theirs). Agreed by all ranks at the group's first transfer (what a rank can
        do is fixed while the group lives: its receive mode came with its registration)."""
        if self._link_copies is None:
            self._link_copies = self._control.all_agree(mine, deadline)
        elif self._link_copies and not mine:
            raise TransferError(
                f"rank {self.rank}: this CUDA IPC group agreed on link copies, but the rank "
                "now stages its weights (a new group is needed)"
            )
        return self._link_copies

    @property
    def agreed_link_copies(self) -> bool:
        """Whether the group already agreed on link copies (at its first transfer)."""
        return bool(self._link_copies)

    def copy_stream(self) -> torch.cuda.Stream:
        """The stream a receiver's link copies run on (channel 0's transfer stream)."""
        return self._copy[0]

    def sum_stream(self) -> torch.cuda.Stream:
        """The stream a sender's checksums run on (channel 0's side stream)."""
        return self._channels.side[0]

    def send_control(self, peer: int, data: bytes, tag: int) -> Any:
        """Post `data` to `peer` over the control channel; returns what `finish_sends` waits
        for (the bytes stay referenced until then)."""
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            return (self._pgs[0].send([out], peer, tag), out)
        except RuntimeError as exc:  # Gloo: the peer's connection is gone
            raise PeerFailure(
                f"rank {self.rank}: CUDA IPC control message to rank {peer} failed: {exc}"
            ) from exc

    def finish_sends(self, sends: Sequence[Any], deadline: float) -> None:
        """Wait for posted control sends (once the peers answered, they have them)."""
        for work, _ in sends:
            where = f"rank {self.rank}: a CUDA IPC control message"
            self._wait_work(self._waits.submit(work, deadline), deadline, where)

    def recv_control(self, peer: int, nbytes: int, tag: int, deadline: float, where: str) -> bytes:
        """`nbytes` from `peer` over the control channel, waiting up to `deadline`."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.recv_control_upto(peer, buf, tag, deadline, where).tobytes()

    def recv_control_upto(
        self, peer: int, buf: torch.Tensor, tag: int, deadline: float, where: str
    ) -> memoryview:
        """A control message from `peer` into `buf` (uint8, host; Gloo fills it with what
        was sent, so the message must say its own length), waiting up to `deadline`. A
        longer message than `buf` aborts this process (Gloo's receive enforces it), so its
        size must be a bound every peer keeps whatever it believes (`MANIFEST_LIMIT`)."""
        try:
            work = self._pgs[0].recv([buf], peer, tag)
        except RuntimeError as exc:  # Gloo: the peer's connection is gone
            raise PeerFailure(f"{where}: control message failed: {exc}") from exc
        self._wait_work(self._waits.submit(work, deadline), deadline, where)
        return buf.numpy().data

    def _wait_work(self, pending: Pending, deadline: float, where: str) -> None:
        """Wait for one control message, acknowledging completed copies meanwhile."""
        delay = 1e-5
        while not pending.done.is_set():
            self._progress()
            if self._aborted:
                raise TransferError(f"{where}: transport aborted")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{where}: the peer did not hand out its buffer in time")
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
        if pending.error is not None:
            raise PeerFailure(f"{where}: control message failed: {pending.error}")

    def _progress(self) -> None:
        """Acknowledge every receive whose copy completed (in any channel)."""
        while self._incoming and self._incoming[0].event.query():  # type: ignore[no-untyped-call]
            done = self._incoming.popleft()
            ack = torch.frombuffer(bytearray(ACK.pack(done.seq)), dtype=torch.uint8)
            self._ack_sends.append((self._pgs[done.channel].send([ack], done.peer, _TAG_ACK), ack))
        # Gloo sends go out without a wait; their works are let go once long done.
        while len(self._ack_sends) > 256:
            work, _ = self._ack_sends.popleft()
            work.wait()

    def fence(self, handle: Handle) -> Handle:
        state: _State = handle.payload
        state.events.append(self._channels.side_event(handle.channel))
        return handle

    def poll(self, handle: Handle) -> bool:
        self._progress()
        state: _State = handle.payload
        return all(e.query() for e in state.events) and all(  # type: ignore[no-untyped-call]
            p.done.is_set() for p, _, _, _ in state.acks
        )

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        delay = 2e-5
        while not self.poll(handle):
            if self._aborted:
                raise TransferError(f"rank {self.rank}: transport aborted")
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"rank {self.rank}: a CUDA IPC transfer on channel {handle.channel} did not "
                    "complete in time"
                )
            if cancel is not None and cancel.is_set():
                raise TransferError(f"rank {self.rank}: transfer cancelled")
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
        state: _State = handle.payload
        for pending, ack, peer, seq in state.acks:
            where = self._where(handle.channel, self.rank, peer, seq)
            if pending.error is not None:
                raise PeerFailure(f"{where}: no acknowledgement: {pending.error}")
            (got,) = ACK.unpack(ack.numpy().tobytes())
            if got != seq:
                raise TransferError(f"{where}: acknowledged as message {got}")
        state.acks.clear()
        # Acknowledged: the receiver has the record (and inline bytes); these waits return.
        for work in state.sends:
            work.wait()
        state.sends.clear()

    # -- teardown -------------------------------------------------------------------------------

    def _quiesce(self) -> None:
        # Copies may still read mapped memory: finish them before the mappings go.
        for s in self._copy:
            with contextlib.suppress(RuntimeError):
                s.synchronize()
        self._incoming.clear()
        self._opened.clear()
        self._shared.clear()

    def abort(self) -> None:
        self._aborted = True
        self._quiesce()
        self._control.abort()
        self._waits.close()

    def close(self) -> None:
        self._quiesce()
        for work, _ in self._ack_sends:
            work.wait()
        self._ack_sends.clear()
        self._control.close()
        self._waits.close()
