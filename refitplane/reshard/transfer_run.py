"""One execution of a rank plan (`TransferRun`, the executor's posting loop): messages added
to their channel's group in schedule order, groups posted and completed within the staging
budget (`group_posting`), staged buckets applied at their boundaries, deltas exchanged, and
the checksum tables filled for their exchange at the end (`run_checksums`). A run may be
armed before its start (`arm`). Kept out of `Executor` so nothing leaks between refits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from refitplane.errors import TransferError, TransferTimeout
from refitplane.reshard.delta_exchange import DeltaExchange, DeltaLinks
from refitplane.reshard.group_posting import GroupPosting
from refitplane.reshard.link_agreement import without_full_links
from refitplane.reshard.message_io import MessageIO, resolve_message
from refitplane.reshard.op_group import GROUP_MAX_OPS, OpGroup, group_limit
from refitplane.reshard.run_checksums import RunChecksums, TableExchange
from refitplane.reshard.schedule import Message
from refitplane.reshard.staged import StagedBucket, StagedShards
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import P2POp

if TYPE_CHECKING:
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.prepared_plan import PreparedPlan
    from refitplane.reshard.staging import StagingRing
    from refitplane.reshard.transfer_report import ProgressFn
    from refitplane.reshard.transport.base import Transport


class TransferRun(GroupPosting):
    """State of one execution (kept out of `Executor` so nothing leaks between refits)."""

    def __init__(
        self,
        transport: Transport,
        config: TransferConfig,
        ring: StagingRing,
        prepared: PreparedPlan,
        progress: ProgressFn | None,
        cancel: threading.Event | None,
        started: float,
        staged: StagedShards | None = None,
        delta: DeltaLinks | None = None,
        never_pays: bool = False,
    ) -> None:
        self.t = transport
        self.schedule = prepared.schedule
        self.report = TransferReport()
        delta, self.report.delta_full_links = without_full_links(
            delta, prepared.plan.rank, prepared.schedule.messages_per_link, transport.full_links
        )
        self.delta = (
            DeltaExchange(prepared.plan.rank, delta, transport.device)
            if delta is not None and delta.peers
            else None
        )
        self.cfg = config
        self.ring = ring
        self.plan = plan = prepared.plan
        self.rank = plan.rank
        self.progress = progress
        self.cancel = cancel
        self.started = started
        self.deadline = started + self.cfg.timeout_s
        self.steps = prepared.steps
        self.tables = prepared.tables
        self.staged = staged
        self.buckets = prepared.buckets if staged is not None else ()
        self.bucket_spans = prepared.bucket_steps if staged is not None else ()
        self.bucket_starts = {span.start: b for b, span in enumerate(self.bucket_spans)}
        self.open_bucket: StagedBucket | None = None
        # The open bucket's steps, their staged messages resolved against its memory.
        self.resolved: dict[int, tuple[tuple[Message, MessageIO | None], ...]] = {}
        if self.tables is not None:
            self.tables.reset()
        self.verify = self.cfg.verify_checksums
        # `never_pays`: what this rank, as a sender, tells its receivers in the checksum
        # exchange at the end (`run_checksums`).
        self.checksums = RunChecksums(
            self.rank,
            self.schedule.messages_per_link if self.verify else {},
            transport.device,
            never_pays,
        )
        self.pending: dict[int, OpGroup] = {}
        self.in_flight: deque[OpGroup] = deque()
        self.receives_posted = False
        self.report.tensors_total = prepared.tensors_received
        self.total = plan.send_bytes + plan.recv_bytes
        self.done = 0
        # How many times groups were posted: the first groups grow with it (`group_limit`).
        self.posts = 0
        # Keep two groups per channel in flight within the staging budget (what the staged
        # arena leaves of it: the ring is smaller only where the packed messages need less).
        self.group_staged = max(1, prepared.ring_room // (2 * self.cfg.num_channels))
        # `arm`: the steps added before StartTransfer, whether the last of them filled a group
        # (posted first thing), and the stream the channels were ordered after.
        self.armed = False
        self.next_step = 0
        self.flush_first = False
        self.began_after: torch.cuda.Stream | None = None

    # -- before StartTransfer ---------------------------------------------------------------------

    def arm(self) -> None:
        """At PrepareRefit, after the rank reported prepared (its weights held: a trainer's
        read-lock, a paused engine): everything of the run up to its first post that needs
        no peer, so that StartTransfer goes straight to posting. The channels are ordered
        after the work already queued (what last wrote the weights was queued before they
        were held), the staging ring is reserved, and the leading steps whose messages go
        straight from/to parameter memory are added to their groups: host bookkeeping only,
        nothing launched or posted (a step that packs, stages or needs a staging slice
        waits for the start). On 2xH100 a Qwen3-8B rank spent 0.8-1.0 ms from its
        StartTransfer to its first post, ~2 % of the transfer (fourteenth session)."""
        if self.staged is not None or self.delta is not None:
            raise TransferError(
                f"rank {self.rank}: a run that stages or exchanges deltas is not armed"
            )
        self._begin()
        self.ring.reserve()
        self.report.ring_bytes = self.ring.size
        i = 0
        while i < len(self.steps) and not self.flush_first:
            if not all(io is not None and io.direct is not None for _, io in self.steps[i]):
                break
            self.flush_first = self._add_step(i)
            i += 1
        self.next_step = i
        self.armed = True

    def start(
        self, progress: ProgressFn | None, cancel: threading.Event | None, started: float
    ) -> None:
        """An armed run's StartTransfer: its deadline and progress count from now."""
        self.progress, self.cancel, self.started = progress, cancel, started
        self.deadline = started + self.cfg.timeout_s

    def _begin(self) -> None:
        if self.t.device.type == "cuda":
            self.began_after = torch.cuda.current_stream(self.t.device)
        self.t.begin()

    # -- main loop ----------------------------------------------------------------------------

    def execute(self) -> TransferReport:
        if not self.armed:
            self._begin()
        elif self.t.device.type == "cuda" and (
            torch.cuda.current_stream(self.t.device) != self.began_after
        ):
            # Started on a thread whose current stream is not the one armed on: the
            # channels also follow what this one queued.
            self._begin()
        # Connected before the first op: posting then never waits for a peer (nccl.py).
        peers = {link.dst for link in self.plan.sends} | {link.src for link in self.plan.recvs}
        self.t.connect(sorted(peers), self.deadline)
        if self.staged is not None:
            # Before any byte moves: the staging arena (and the ring below), so that nothing
            # allocates while transfers are in flight.
            self.staged.begin(self.buckets)
            self.report.staged_buckets = len(self.buckets)
            self.report.staged_peak_bytes = self.staged.staging_peak_bytes
        if not self.armed:
            # Sized for this plan (none where every message goes direct); kept between
            # refits, except by staged receivers, which free it after each.
            self.ring.reserve()
            self.report.ring_bytes = self.ring.size
        if self.delta is not None:
            began = time.monotonic()
            self._exchange_delta_headers(self.delta)
            self.report.delta_base_advanced = self.delta.advanced
            self.report.delta_seconds = time.monotonic() - began
        wire_began = time.monotonic()
        if self.flush_first:
            self._flush_all()  # the groups `arm` filled
        for i in range(self.next_step, len(self.steps)):
            self._check_cancel()
            bucket = self.bucket_starts.get(i)
            if bucket is not None:
                self._next_bucket(self.buckets[bucket])
            if self._add_step(i):
                # Every channel at once, never one alone: see `_flush_all`.
                self._flush_all()
            self._retire_completed()
        swap = self._drain(last=True)
        self.report.wire_seconds = time.monotonic() - wire_began
        if self.verify:
            t0 = time.perf_counter()
            self.report.tensors_verified = self.checksums.verify(
                self.t,
                self.deadline,
                self.cancel,
                self.schedule.messages,
                self.report.tensors_total,
                swap,
            )
            self.report.verify_seconds = time.perf_counter() - t0
        self.t.end()
        return self.report

    def _drain(self, last: bool = False) -> TableExchange | None:
        """Post everything pending and complete everything in flight. After the `last`
        message, where the device orders the work, the checksum tables' swap is posted
        before the wait (`RunChecksums.exchange`), and returned."""
        self._flush_all()
        self.report.posted_seconds = time.monotonic() - self.started
        swap = None
        if last and self.verify and self.t.device_ordered:
            swap = self.checksums.exchange(self.t, self.deadline)
        while self.in_flight:
            self._complete_oldest()
        self.ring.settled()
        return swap

    def _next_bucket(self, bucket: StagedBucket) -> None:
        """With nothing in flight: apply the open bucket (every byte of it arrived and was
        checksummed), then give `bucket` memory and resolve its messages against it."""
        if self.staged is None:
            return
        self._drain()
        if self.open_bucket is not None:
            self.staged.close(self.open_bucket)
            self.report.staged_applied += 1
        self.staged.open(bucket)
        self.open_bucket = bucket
        specs = self.plan.specs
        for i in self.bucket_spans[bucket.index]:
            self.resolved[i] = tuple(
                (m, io if io is not None else resolve_message(m, self.staged, specs))
                for m, io in self.steps[i]
            )

    def _exchange_delta_headers(self, deltas: DeltaExchange) -> None:
        """Before the first message: encode this rank's delta messages, then swap the header
        tables of its delta links (one group), so both ends know every payload's size."""
        specs = self.plan.specs
        deltas.encode(
            ((m, io) for step in self.steps for m, io in step if m.src == self.rank and io),
            specs,
            self.checksums.row if self.verify else None,
        )
        recvs = [(m, io) for step in self.steps for m, io in step if m.dst == self.rank]
        deltas.expect(m for m, _ in recvs)
        # While the senders scan: the sums of this rank's in-place images, kept current by
        # the applies (no pass over them after the transfer).
        deltas.presum(((m, io) for m, io in recvs if io is not None), self.checksums.sums)
        ops = [
            P2POp(True, dst, table.view(-1).view(torch.uint8))
            for dst, table in sorted(deltas.headers_out.items())
        ] + [
            P2POp(False, src, table.view(-1).view(torch.uint8))
            for src, table in sorted(deltas.headers_in.items())
        ]
        self.report.delta_tables = len(ops)
        if self.t.device.type == "cuda" and deltas.headers_out:
            # The scan's counts and the header tables are on the device before they go (a
            # receiver does not wait here for its `presum`).
            torch.cuda.current_stream(self.t.device).synchronize()
        # The payloads, in parts the sends wait for on the device (`_flush`).
        deltas.launch_payloads()
        if ops:
            with self.t.channel_context(0):
                handle = self.t.fence(self.t.issue(0, ops, self.deadline))
            self.t.wait(handle, self.deadline, self.cancel)
        deltas.receive(specs)

    def _add_step(self, i: int) -> bool:
        """Add step `i`'s messages to their channels' groups; whether one is now full."""
        full = False
        limit = group_limit(
            self.posts, self.schedule.bytes_after[i], self.cfg.bucket_bytes, self.cfg.num_channels
        )
        for m, io in self.resolved.pop(i, self.steps[i]):
            if io is None:
                raise TransferError(
                    f"rank {self.rank}: message {m.round} from rank {m.src} to rank {m.dst} "
                    f"(first tensor {m.chunks[0].tensor!r}) has no memory: its stage is in "
                    "no staged bucket"
                )
            t0 = time.perf_counter()
            self._add(m, io)
            self.report.host_add_seconds += time.perf_counter() - t0
            group = self.pending[m.channel]
            full = full or (
                group.nbytes >= limit
                or group.staged >= self.group_staged
                or len(group.ops) >= GROUP_MAX_OPS
            )
        return full

    def _add(self, m: Message, io: MessageIO) -> None:
        sending = m.src == self.rank
        delta = self.delta.find(m) if self.delta is not None else None
        # A sender's staged delta message was packed while encoding (`DeltaMessage.image`):
        # that image is checksummed, only the payload travels, no staging slice is taken.
        encoded = delta.image if delta is not None else None
        if encoded is not None:
            buf = encoded
        elif io.direct is not None:
            buf = io.direct
        else:
            taken = self.ring.try_take(m.nbytes)
            while taken is None:
                # Post everything first: a wait must never depend on an unposted op. Where
                # the device orders reuse, posting gives the slices back (`_flush`), so the
                # host waits for a group only if that still leaves no room.
                self._flush_all()
                taken = self.ring.try_take(m.nbytes)
                if taken is None:
                    self._complete_oldest()
                    taken = self.ring.try_take(m.nbytes)
            token, buf, follow = taken
            if follow:
                self._follow(m.channel, follow)
        if buf.numel() * buf.element_size() != m.nbytes:
            # NCCL does not exchange sizes: a receive posted shorter or longer than its send
            # shifts every later message on the channel and the pair waits forever on the
            # device, past any host deadline. Refuse it here, naming the message.
            raise TransferError(
                f"rank {self.rank}: message {m.round} from rank {m.src} to rank {m.dst} "
                f"(first tensor {m.chunks[0].tensor!r}) is {m.nbytes} bytes in the plan but "
                f"its {'direct view' if io.direct is not None else 'buffer'} here holds "
                f"{buf.numel() * buf.element_size()}"
            )
        group = self.pending.setdefault(m.channel, OpGroup())
        # Its checksum sums may be taken care of already: the sender's scan added them, or
        # the receiver summed its image before and the apply keeps them current.
        summed = self.delta is not None and (m.src, m.dst, m.round) in self.delta.summed
        if encoded is not None:
            pass
        elif io.direct is None and io.copy is not None and (delta is None or not sending):
            # No per-chunk work here: one kernel launch packs or unpacks the message.
            group.slices.append(token)
            group.staged += m.nbytes
            if sending:
                # The pack adds the checksum sums of whole words as it copies them.
                row = None
                if self.verify and io.copy.whole_words:
                    row = self.checksums.row(m)
                    summed = True
                group.pack_tables.append((io.copy, buf, row))
            else:
                if delta is not None:
                    # A delta receiver starts from its own bytes (the base) in the slice,
                    # alignment gaps zero as on the sender (the checksums cover them).
                    with self.t.channel_context(m.channel):
                        buf.zero_()
                    group.pack_tables.append((io.copy, buf, None))
                group.unpack_tables.append((io.copy, buf))
        elif io.direct is None:
            group.slices.append(token)
            group.staged += m.nbytes
            parts = io.parts(buf)
            staged = parts if not io.strided else [parts[i] for i in io.flat]
            if delta is not None:
                # Checksums cover the alignment gaps: zero on both ends of a delta message
                # (a full message carries the sender's gaps to the receiver).
                with self.t.channel_context(m.channel):
                    buf.zero_()
            # A delta receiver starts from its own bytes (the base) in the slice.
            if sending or delta is not None:
                group.pack_dst += staged
                group.pack_src += io.flat_views
                if io.strided:
                    with self.t.channel_context(m.channel):
                        for chunk in io.strided:
                            chunk.typed(parts[chunk.index]).copy_(chunk.view)
            if not sending:
                group.unpack_dst += io.flat_views
                group.unpack_src += staged
                group.unpack_strided += [(parts[c.index], c) for c in io.strided]
        if self.verify and not summed:
            # Summed with the group, off the transfer's path: the sender reads the packed
            # (or parameter) bytes, which stay untouched until the group completes; the
            # receiver what arrived (for direct messages, the parameters themselves).
            group.sum_bufs.append(buf)
            group.sum_rows.append(self.checksums.row(m))
        wire = buf
        if delta is not None:
            # The sender still packs and checksums its full bytes; the payload travels.
            wire = delta.payload
            if not sending:
                group.delta_apply.append((buf, delta))
        group.ops.append(P2POp(sending, m.dst if sending else m.src, wire))
        group.messages.append(m)
        group.nbytes += m.nbytes
        payload = io.payload
        group.payload += payload
        r = self.report
        r.messages += 1
        if delta is not None:
            r.delta_messages += 1
            payload = delta.header.nbytes  # what the wire carries
        if sending:
            r.bytes_full += io.payload
        if io.direct is not None:
            r.direct_messages += 1
        else:
            r.packed_messages += 1
        if sending:
            r.bytes_sent += payload
        else:
            r.bytes_received += payload

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TransferError(f"rank {self.rank}: transfer cancelled")
        if time.monotonic() > self.deadline:
            raise TransferTimeout(f"rank {self.rank}: transfer deadline passed")
