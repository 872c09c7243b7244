"""A refit over CUDA IPC as the copy it is: per link, one manifest, the receiver's copies, one
checksum launch per side, one completion.

Over NCCL every byte must travel as messages both ends post; over CUDA IPC the receiver can
read the sender's memory itself, so a link needs no messages, no staging and no per-message
round trips. Per link (sender → receiver) and refit:

1. The sender, once its weights are final (its stream synchronized), sends an
   `IpcManifest`: for every chunk of the link, in the link's chunk order, where its bytes
   lie in the sender's memory (the parameters themselves: nothing is packed, the trainer
   allocates no staging), with the share of each storage (made once per group and kept
   referenced by the sender, so the memory is never freed or reused under the mapping).
   It then sends its chunks' sums (one launch), computed when the refit was prepared
   (`presum`: the trainer's weights are held from PrepareRefit, and the ~5 ms of reads on
   an 8B model no longer compete with the receiver's copies for HBM: TRANSFERRING 22.0 →
   18.6 ms on one H100, ninth session), or now with REFIT_IPC_PRESUM=0.
2. The receiver opens each storage once (held until the group ends) and builds every
   chunk's source view (kept while the sender's manifest stays byte-identical, i.e. the
   same memory), then copies every chunk straight into its destination (vLLM's live
   parameters; `link_copies.py`): on one GPU one kernel launch copies every contiguous
   chunk and checksums the words it writes (`copy_sums.py`: one read and one write per
   byte); from a peer GPU, and for strided (resharded) boxes, `copy_` and one checksum
   launch after. It compares the sender's sums per chunk and sends one completion (ok,
   mismatch or failed): only then may the sender's memory change again.

Checksums are per chunk (a row each, both ends, in chunk order), so a mismatch names the
tensor and box. A strided chunk is checksummed through a contiguous copy of it, a few at a
time within `max_inflight_bytes`. A receiver that fails after its manifest arrived (a
handle that does not open: the sender exited) tells its senders before it raises, so
neither end waits for the deadline; the executor aborts the transport on any error.

Used where the transport `copies_links` (CUDA IPC), except for receivers that stage their
weights (`StagedShards`) and delta refits (never on a CUDA IPC group), which run messages.
REFIT_IPC_LINK_COPIES=0 runs messages on CUDA IPC too (to compare; both ends must agree).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refitplane.errors import (
    ChecksumMismatch,
    PeerFailure,
    RefitError,
    TransferError,
    TransferTimeout,
)
from refitplane.reshard.boxes import format_box
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.link_copies import (
    ChunkSums,
    LocalChunk,
    ReceiverCopies,
    chunk_source,
    link_chunks,
)
from refitplane.reshard.message_io import MessageIO
from refitplane.reshard.schedule import Message
from refitplane.reshard.transport.ipc_manifest import (
    COMPLETION,
    DONE_FAILED,
    DONE_MISMATCH,
    DONE_OK,
    MANIFEST_LIMIT,
    IpcManifest,
    check_manifest_size,
    decode_completion,
    encode_completion,
    manifest_in,
)
from refitplane.reshard.transport.ipc_records import IpcRecord

if TYPE_CHECKING:
    from refitplane.reshard.transfer_report import TransferReport
    from refitplane.reshard.transport.cuda_ipc import CudaIpcTransport

ENABLED = os.environ.get("REFIT_IPC_LINK_COPIES", "1") != "0"
# A receiver copies contiguous, aligned chunks of one device with the kernel that checksums
# as it copies (`copy_sums.py`); off: `copy_`, then the checksum launch (a receiver decides
# alone; benchmarks turn it off to compare).
FUSE = os.environ.get("REFIT_IPC_FUSED_COPY", "1") != "0"

# A sender checksums its chunks when the refit is prepared (`presum`, the default: 3.4 ms off
# the colocated Qwen3-8B shape's TRANSFERRING on one H100); REFIT_IPC_PRESUM=0: during the
# transfer, as the receivers copy.
PRESUM = os.environ.get("REFIT_IPC_PRESUM", "1") != "0"

_TAG_MANIFEST = 12
_TAG_SUMS = 13
_TAG_DONE = 14


@dataclass
class _Outgoing:
    """A sender's link, kept while the plan's views stay the same."""

    peer: int
    chunks: list[LocalChunk]
    manifest: bytes = b""
    sums: torch.Tensor | None = None
    summer: ChunkSums | None = None
    # The storages (data pointers) the manifest names, and whether shares the peer no
    # longer maps were let go since it was built.
    storages: frozenset[int] = frozenset()
    pruned: bool = False


@dataclass
class _Incoming:
    """A receiver's link: its chunks, and the copies built from the sender's last manifest."""

    peer: int
    chunks: list[LocalChunk]
    manifest: bytes = b""
    copies: ReceiverCopies | None = None
    # The sender's storages the copies map.
    storages: tuple[IpcRecord, ...] = ()
    # Where its manifests arrive (`MANIFEST_LIMIT` bytes of host memory, allocated once:
    # only each message's bytes are touched).
    inbox: torch.Tensor | None = None


@dataclass
class LinkCopies:
    """A rank's links for link copies, built once per prepared plan (see `Executor`)."""

    key: object
    outgoing: list[_Outgoing]
    incoming: list[_Incoming]
    # The outgoing links' sums were launched when the refit was prepared (`presum`), on the
    # transport's sum stream: the next run sends them instead of checksumming then.
    presummed: bool = False
    # Set when they were taken at the end of an optimizer step (`Executor.presum_links`'s
    # `after_step`): the trainer's weight-write count then. A PrepareRefit that finds the
    # same count keeps them (nothing wrote the weights since); any other takes them again.
    presummed_after_write: int | None = None

    @staticmethod
    def build(
        key: object, steps: Sequence[Sequence[tuple[Message, MessageIO | None]]], rank: int
    ) -> LinkCopies:
        sends, recvs = link_chunks(steps, rank)
        return LinkCopies(
            key,
            [_Outgoing(p, c) for p, c in sorted(sends.items())],
            [_Incoming(p, c) for p, c in sorted(recvs.items())],
        )


def _launch_sums(transport: CudaIpcTransport, links: LinkCopies, budget: int) -> None:
    """Checksum every outgoing chunk into its link's rows, on the transport's sum stream."""
    with torch.cuda.stream(transport.sum_stream()):
        for out in links.outgoing:
            if out.sums is None or out.summer is None:
                out.sums = torch.zeros(
                    (len(out.chunks), 2), dtype=torch.int64, device=transport.device
                )
                out.summer = ChunkSums(out.chunks, out.sums.unbind(0), budget)
            else:
                out.sums.zero_()
            out.summer.launch()


def presum(
    transport: CudaIpcTransport, links: LinkCopies, budget: int, after_write: int | None = None
) -> None:
    """Checksum a sender's outgoing chunks now, when the refit is prepared, so that its
    transfer only sends the sums and the receivers' copies have the memory to themselves.

    The caller holds the weights from here until the refit ends (the trainer's read-lock,
    taken at PrepareRefit); should they change anyway (the hold expired), the receivers'
    sums of what they copied differ from these and the refit fails as a mismatch. The sums
    follow the caller's stream (the optimizer step) through an event: nothing waits here."""
    if not links.outgoing:
        return
    final = torch.cuda.Event()  # type: ignore[no-untyped-call]
    final.record(torch.cuda.current_stream(transport.device))
    transport.sum_stream().wait_event(final)
    _launch_sums(transport, links, budget)
    links.presummed = True
    links.presummed_after_write = after_write


def _differing_rows(mine: torch.Tensor, theirs: bytes) -> list[int]:
    """The chunks whose sums differ: equal tables compare as bytes (one host compare), only
    a mismatch pays for the per-row search that names the tensors."""
    if mine.numpy().tobytes() == theirs:
        return []
    other = torch.frombuffer(bytearray(theirs), dtype=torch.int64).view(-1, 2)
    return [int(i) for i in (mine != other).any(dim=1).nonzero().flatten().tolist()]


class LinkCopyRun:
    """One refit of a rank's links over a `CudaIpcTransport` (see the module)."""

    def __init__(
        self,
        transport: CudaIpcTransport,
        links: LinkCopies,
        *,
        rank: int,
        specs: dict[str, TensorSpec],
        report: TransferReport,
        deadline: float,
        budget: int,
        verify: bool,
        cancel: threading.Event | None,
        on_receive: Callable[[], None],
    ) -> None:
        self.t = transport
        self.links = links
        self.rank = rank
        self.specs = specs
        self.report = report
        self.deadline = deadline
        self.budget = budget
        self.verify = verify
        self.cancel = cancel
        self.on_receive = on_receive
        self._sends: list[Any] = []
        self._answered: set[int] = set()

    def _where(self, src: int, dst: int) -> str:
        return f"rank {self.rank}: CUDA IPC link from rank {src} to rank {dst}"

    def _check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TransferError(f"rank {self.rank}: transfer cancelled")
        if time.monotonic() > self.deadline:
            raise TransferTimeout(f"rank {self.rank}: transfer deadline passed")

    def execute(self) -> None:
        device = self.t.device
        # The weights are final (the caller's stream, e.g. the optimizer step) before any
        # receiver reads them; a receiver's copies follow its own earlier work.
        torch.cuda.current_stream(device).synchronize()
        self.t.begin()
        for out in self.links.outgoing:
            self._offer(out)
        if self.verify and self.links.outgoing:
            self._send_sums()
        self.links.presummed = False  # used, or stale: the next refit's prepare sums again
        self.links.presummed_after_write = None
        try:
            wire_began = time.monotonic()
            for inc in self.links.incoming:
                self._copy(inc)
            self._finish_receives()
            # Over CUDA IPC the report's parts are: `host_wait_seconds` the manifests' wait
            # (how long after this rank's start its senders' arrived), `wire_seconds` from
            # the first manifest asked to the copies' end, `verify_seconds` the sums'
            # compare and the answers.
            if self.links.incoming:
                self.report.wire_seconds = time.monotonic() - wire_began
        except BaseException:
            # Tell the senders not to wait for this rank (best effort: the error follows).
            failed = len(self._sends)
            for inc in self.links.incoming:
                if inc.peer not in self._answered:
                    with contextlib.suppress(RefitError):  # that peer may be what failed
                        self._answer(inc.peer, DONE_FAILED)
            with contextlib.suppress(RefitError):
                self.t.finish_sends(self._sends[failed:], time.monotonic() + 2.0)
            raise
        waited = time.perf_counter()
        for out in self.links.outgoing:
            self._await_completion(out)
        if self.links.outgoing:
            # A sender's wait: its receivers' copies and compares.
            self.report.host_wait_seconds += time.perf_counter() - waited
        self.t.finish_sends(self._sends, self.deadline)
        self.t.end()

    # -- sender --------------------------------------------------------------------------------

    def _offer(self, out: _Outgoing) -> None:
        """Send the link's manifest (built once while the views and shares stay the same)."""
        if not out.manifest:
            storages: dict[int, int] = {}
            records: list[IpcRecord] = []
            rows = []
            for lc in out.chunks:
                storage = lc.view.untyped_storage()
                index = storages.get(storage.data_ptr())
                if index is None:
                    index = storages[storage.data_ptr()] = len(records)
                    records.append(self.t.share_storage(storage, out.peer, index))
                rows.append(chunk_source(lc.view, index))
            manifest = IpcManifest(self.t.shares, tuple(records), tuple(rows)).encode()
            check_manifest_size(manifest, where=self._where(self.rank, out.peer))
            out.manifest = manifest
            out.storages = frozenset(storages)
            out.pruned = False
        self._sends.append(self.t.send_control(out.peer, out.manifest, _TAG_MANIFEST))
        for lc in out.chunks:
            self.report.bytes_sent += lc.chunk.nbytes
        self.report.bytes_full += sum(lc.chunk.nbytes for lc in out.chunks)

    def _send_sums(self) -> None:
        """Send each link's sums: those launched at prepare (`presum`), else checksum every
        outgoing chunk now (while the receivers copy)."""
        if not self.links.presummed:
            _launch_sums(self.t, self.links, self.budget)
        self.t.sum_stream().synchronize()
        for out in self.links.outgoing:
            assert out.sums is not None
            data = out.sums.cpu().numpy().tobytes()
            self._sends.append(self.t.send_control(out.peer, data, _TAG_SUMS))

    def _await_completion(self, out: _Outgoing) -> None:
        where = self._where(self.rank, out.peer)
        data = self.t.recv_control(out.peer, COMPLETION.size, _TAG_DONE, self.deadline, where)
        status = decode_completion(data, where=where)
        if status == DONE_FAILED:
            raise PeerFailure(f"{where}: the receiver failed to copy the link (see its error)")
        # DONE_MISMATCH: the receiver reports it (its weights are not verified); this rank's
        # memory is no longer read either way.
        if not out.pruned:
            # The receiver built its copies from this manifest: what it no longer names
            # (parameters reallocated since the last one) is no longer mapped there.
            self.t.release_shares(out.peer, out.storages)
            out.pruned = True

    # -- receiver ------------------------------------------------------------------------------

    def _copy(self, inc: _Incoming) -> None:
        self._check()
        where = self._where(inc.peer, self.rank)
        waited = time.perf_counter()
        if inc.inbox is None:
            inc.inbox = torch.empty(MANIFEST_LIMIT, dtype=torch.uint8)
        received = self.t.recv_control_upto(
            inc.peer, inc.inbox, _TAG_MANIFEST, self.deadline, where
        )
        data = manifest_in(received, where=where)
        # Zero what this manifest used: a later header that claims more than its message
        # then reads zeros (refused), never the rows of an earlier manifest.
        inc.inbox[: len(data)].zero_()
        self.report.host_wait_seconds += time.perf_counter() - waited
        if data != inc.manifest or inc.copies is None or inc.copies.fuse != (FUSE and self.verify):
            self._build(inc, data, where)
        assert inc.copies is not None
        self.on_receive()
        with torch.cuda.stream(self.t.copy_stream()):
            inc.copies.launch()
        payload = sum(lc.chunk.nbytes for lc in inc.chunks)
        self.report.bytes_received += payload
        self.report.messages += len(inc.chunks)
        self.report.direct_messages += len(inc.chunks)
        self.report.groups += 1

    def _build(self, inc: _Incoming, data: bytes, where: str) -> None:
        """Open the manifest's storages (once per group) and build the link's copies."""
        manifest = IpcManifest.decode(data, where=where)
        names = [lc.chunk.tensor for lc in inc.chunks]
        manifest.check_sizes([lc.chunk.nbytes for lc in inc.chunks], where=where, names=names)
        storages = [self.t.open_storage(r, f"{where}, storage {r.seq}") for r in manifest.storages]
        named = {(r.handle, r.storage_offset) for r in manifest.storages}
        self.t.close_storages(r for r in inc.storages if (r.handle, r.storage_offset) not in named)
        inc.storages = manifest.storages
        inc.copies = ReceiverCopies.build(
            inc.chunks,
            manifest,
            storages,
            self.specs,
            where,
            verify=self.verify,
            fuse=FUSE and self.verify,
            device=self.t.device,
            budget=self.budget,
        )
        inc.manifest = data

    def _finish_receives(self) -> None:
        """Wait for the copies, compare every link's sums with its sender's, answer each."""
        if not self.links.incoming:
            return
        theirs: dict[int, bytes] = {}
        if self.verify:
            for inc in self.links.incoming:
                where = self._where(inc.peer, self.rank)
                theirs[inc.peer] = self.t.recv_control(
                    inc.peer, len(inc.chunks) * 16, _TAG_SUMS, self.deadline, where
                )
        self.t.copy_stream().synchronize()
        compared = time.perf_counter()
        mismatch: ChecksumMismatch | None = None
        for inc in self.links.incoming:
            status = DONE_OK
            if self.verify:
                assert inc.copies is not None
                assert inc.copies.sums is not None
                bad = _differing_rows(inc.copies.sums.cpu(), theirs[inc.peer])
                if bad:
                    status = DONE_MISMATCH
                    if mismatch is None:
                        first = [inc.chunks[i].chunk for i in bad[:4]]
                        where = ", ".join(f"{c.tensor!r} {format_box(c.box)}" for c in first)
                        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
                        mismatch = ChecksumMismatch(
                            f"rank {self.rank}: bytes from rank {inc.peer} do not match the "
                            f"sender's checksum ({len(bad)} of {len(inc.chunks)} chunk(s)); "
                            f"first: {where}{more}"
                        )
            self._answer(inc.peer, status)
        self.report.verify_seconds = time.perf_counter() - compared
        if mismatch is not None:
            raise mismatch

    def _answer(self, peer: int, status: int) -> None:
        self._answered.add(peer)
        self._sends.append(self.t.send_control(peer, encode_completion(status), _TAG_DONE))
