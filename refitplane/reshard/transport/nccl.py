"""nccl4py transport (GPU): one non-blocking communicator and one CUDA stream per channel.

Rendezvous: group rank 0 mints one 128-byte NCCL unique id per channel; the coordinator
relays the concatenated bytes. Communicators are non-blocking, so every call returns at
once and every wait is a poll with a deadline (CUDA event + `get_async_error`); on error or
timeout the communicators are aborted, which releases peers stuck in the same group.
Buffers are uint8 views; nccl4py does not check strides, so the executor only ever passes
contiguous buffers.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from refitplane.errors import InvalidArgument, PeerFailure, TransferError, TransferTimeout
from refitplane.reshard.transport.base import Handle, P2POp
from refitplane.reshard.transport.streams import ChannelStreams, StreamedTransport

UID_BYTES = 128
# Longest sleep between two polls of a wait. A group of 192 MiB takes ~0.5 ms on NVLink:
# a host that slept up to 1 ms after it completed left the link idle for as long (the MoE
# shape's ~500 messages wait on a full staging ring hundreds of times per refit).
_MAX_POLL_S = 5e-5
# How long posting polls a communicator without sleeping before it sleeps between polls.
_SPIN_S = 2e-4


def _nccl() -> tuple[Any, Any]:
    """nccl4py's core module and its bindings (imported lazily: GPU machines only)."""
    try:
        import nccl.core as nc
        from nccl.bindings import nccl as nb
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise TransferError(
            "the NCCL backend needs nccl4py (pip install 'refit-plane[nccl]')"
        ) from exc
    return nc, nb


def create_nccl_rendezvous(num_channels: int) -> bytes:
    """Mint one unique id per channel (on group rank 0; needs libnccl, not a GPU)."""
    nc, _ = _nccl()
    return b"".join(bytes(nc.get_unique_id()) for _ in range(num_channels))


class NcclTransport(StreamedTransport):
    device_ordered = True

    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: bytes,
        *,
        device: torch.device,
        num_channels: int,
        timeout_s: float = 120.0,
    ) -> None:
        if len(rendezvous) != UID_BYTES * num_channels:
            raise InvalidArgument(
                f"NCCL rendezvous must be {num_channels} x {UID_BYTES} bytes, got {len(rendezvous)}",
                field="rendezvous",
            )
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} outside group of {world_size}", field="group_rank")
        nc, nb = _nccl()
        self._nb = nb
        self._uint8 = int(nc.NcclDataType.UINT8)
        self._in_progress = nb.Result.InProgress
        self._success = nb.Result.Success
        self.rank = rank
        self.world_size = world_size
        self.num_channels = num_channels
        self.device = device
        self.timeout_s = timeout_s
        torch.cuda.set_device(device)
        self._comms: list[Any] = []
        deadline = time.monotonic() + timeout_s
        try:
            for c in range(num_channels):
                uid = nc.UniqueId.from_bytes(rendezvous[c * UID_BYTES : (c + 1) * UID_BYTES])
                config = nc.NCCLConfig(blocking=False, comm_name=f"refit-ch{c}")
                self._comms.append(nc.Communicator.init(world_size, rank, uid, config))
            for c, comm in enumerate(self._comms):
                self._settle(comm, deadline, f"joining channel {c}")
        except BaseException:
            self.abort()
            raise
        # Per channel: the NCCL stream, a pack stream (packing the next group overlaps the
        # current transfer; a group waits for its packing just before posting) and a side
        # stream (unpacking and checksums, so the next transfer does not wait for them).
        self._channels = ChannelStreams(device, num_channels)
        self._streams = self._channels.transfer
        # Peers every channel is connected to (`connect`), and its one-byte buffers.
        self._connected: set[int] = set()
        self._handshake: torch.Tensor | None = None

    # -- helpers --------------------------------------------------------------------------

    def _settle(self, comm: Any, deadline: float, what: str) -> None:
        """Poll a non-blocking communicator until its last call finished. A posted group is
        usually taken within microseconds, and the shortest sleep costs ~60 us on Linux
        (timer slack): so spin first, then sleep."""
        delay = 1e-5
        spin_until = time.perf_counter() + _SPIN_S
        while True:
            state = comm.get_async_error()
            if state == self._success:
                return
            if state != self._in_progress:
                raise PeerFailure(
                    f"rank {self.rank}: NCCL error while {what}: {comm.get_last_error()}"
                )
            if time.perf_counter() < spin_until:
                continue
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank {self.rank}: NCCL timed out while {what}")
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)

    def connect(self, peers: Sequence[int], deadline: float) -> None:
        """NCCL connects a channel to a peer lazily, on their first op, and posting that op
        blocks the host until the peer posts on the same channel too. Two ranks whose first
        posts go to different channels (one packs a run the other receives in place, so they
        flush their groups in different orders) would each wait for the other. So before a
        transfer's first op, every channel not yet connected to a peer exchanges one byte
        with it, channel by channel in the same order on every rank: each step waits only
        for peers doing the same step. Once per (peer, channel): later transfers skip it."""
        missing = sorted({p for p in peers if p != self.rank} - self._connected)
        if not missing:
            return
        if self._handshake is None or self._handshake.numel() < 2 * len(missing):
            # Before any transfer is in flight: allocating here cannot stall a peer.
            self._handshake = torch.zeros(
                max(64, 2 * len(missing)), dtype=torch.uint8, device=self.device
            )
        buf = self._handshake
        for channel in range(self.num_channels):
            ops: list[P2POp] = []
            for i, peer in enumerate(missing):
                ops.append(P2POp(True, peer, buf[2 * i : 2 * i + 1]))
                ops.append(P2POp(False, peer, buf[2 * i + 1 : 2 * i + 2]))
            with self.channel_context(channel):
                handle = self.issue(channel, ops, deadline)
            self.wait(handle, deadline)
        self._connected.update(missing)

    # A handle's events are recorded when it is posted: a channel can wait for them, so
    # staging could come back without a host wait. Opt-in (REFIT_DEVICE_REUSE=1) until a GPU
    # run has verified it: on 2026-11-26 its ordering was proven on CPU only
    # (tests/integration/reshard/test_device_reuse_order.py, the device-ordered Gloo test).
    device_reuse = os.environ.get("REFIT_DEVICE_REUSE", "0") == "1"

    def order_after(self, channel: int, handles: Sequence[Handle]) -> None:
        pack = self._channels.pack[channel]
        for handle in handles:
            for event in handle.payload[0]:
                pack.wait_event(event)

    # -- transfers --------------------------------------------------------------------------

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        if not self._comms:
            raise TransferError("transport was aborted; a new group is needed")
        self._check_buffers(ops, "NCCL")
        comm = self._comms[channel]
        self._streams[channel].wait_stream(self._channels.pack[channel])
        stream = self._streams[channel].cuda_stream
        # nccl4py's `Communicator.send` resolves the buffer (DLPack, dtype table, device
        # check) on every call, tens of microseconds; a refit posts hundreds of ops, so
        # they go to the bindings with the pointer checked above.
        nb, handle, uint8 = self._nb, comm._comm, self._uint8
        nb.group_start()
        try:
            for op in ops:
                post = nb.send if op.send else nb.recv
                post(op.buffer.data_ptr(), op.buffer.numel(), uint8, op.peer, handle, stream)
        finally:
            nb.group_end()
        # The first ops to a peer wait for it to connect: bounded by the refit's deadline.
        began = time.perf_counter()
        self._settle(comm, deadline, f"posting on channel {channel}")
        self.settle_seconds += time.perf_counter() - began
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._streams[channel])
        # Keep the buffers referenced until the handle is done (nccl4py does not).
        return Handle(channel, ([event], [op.buffer for op in ops]))

    def fence(self, handle: Handle) -> Handle:
        side = self._channels.side_event(handle.channel)
        return Handle(handle.channel, ([*handle.payload[0], side], handle.payload[1]))

    def poll(self, handle: Handle) -> bool:
        return all(e.query() for e in handle.payload[0])

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        events = handle.payload[0]
        comm = self._comms[handle.channel] if self._comms else None
        delay = 2e-5
        while not all(e.query() for e in events):
            if comm is None:
                raise TransferError("transport was aborted")
            state = comm.get_async_error()
            if state != self._success and state != self._in_progress:
                raise PeerFailure(
                    f"rank {self.rank}: NCCL error on channel {handle.channel}: {comm.get_last_error()}"
                )
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"rank {self.rank}: a transfer on channel {handle.channel} did not complete in time"
                )
            if cancel is not None and cancel.is_set():
                raise TransferError(f"rank {self.rank}: transfer cancelled")
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)

    def abort(self) -> None:
        comms, self._comms = self._comms, []
        for comm in comms:
            with contextlib.suppress(Exception):
                comm.abort()

    def close(self) -> None:
        comms, self._comms = self._comms, []
        deadline = time.monotonic() + self.timeout_s
        for comm in comms:
            comm.finalize()
        try:
            for comm in comms:
                self._settle(comm, deadline, "closing")
        except BaseException:
            for comm in comms:
                with contextlib.suppress(Exception):
                    comm.abort()
            raise
        for comm in comms:
            comm.destroy()
