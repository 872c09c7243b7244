"""One execution of a rank plan (`TransferRun`, the executor's posting loop): messages added
to their channel's group in schedule order, groups posted and completed within the staging
budget, staged buckets applied at their boundaries, deltas exchanged, and the checksum tables
filled for their exchange at the end (`run_checksums`). Kept out of `Executor` so nothing
leaks between refits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from refitplane.errors import TransferError, TransferTimeout
from refitplane.reshard.checksum import accumulate_sums_many
from refitplane.reshard.chunk_copy import launch as launch_copy
from refitplane.reshard.delta_exchange import DeltaExchange, DeltaLinks
from refitplane.reshard.link_agreement import without_full_links
from refitplane.reshard.message_io import MessageIO, resolve_message
from refitplane.reshard.op_group import GROUP_MAX_OPS, OpGroup, group_limit
from refitplane.reshard.run_checksums import RunChecksums, TableExchange
from refitplane.reshard.schedule import Message
from refitplane.reshard.staged import StagedBucket, StagedShards
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import Handle, P2POp

if TYPE_CHECKING:
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.prepared_plan import PreparedPlan
    from refitplane.reshard.staging import StagingRing
    from refitplane.reshard.transfer_report import ProgressFn
    from refitplane.reshard.transport.base import Transport


class TransferRun:
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

    # -- main loop ----------------------------------------------------------------------------

    def execute(self) -> TransferReport:
        self.t.begin()
        # Connected before the first op: posting then never waits for a peer (nccl.py).
        peers = {link.dst for link in self.plan.sends} | {link.src for link in self.plan.recvs}
        self.t.connect(sorted(peers), self.deadline)
        if self.staged is not None:
            # Before any byte moves: the staging arena (and the ring below), so that nothing
            # allocates while transfers are in flight.
            self.staged.begin(self.buckets)
            self.report.staged_buckets = len(self.buckets)
            self.report.staged_peak_bytes = self.staged.staging_peak_bytes
        # Sized for this plan (none where every message goes direct); kept between refits,
        # except by staged receivers, which free it after each.
        self.ring.reserve()
        self.report.ring_bytes = self.ring.size
        if self.delta is not None:
            began = time.monotonic()
            self._exchange_delta_headers(self.delta)
            self.report.delta_base_advanced = self.delta.advanced
            self.report.delta_seconds = time.monotonic() - began
        wire_began = time.monotonic()
        for i, step in enumerate(self.steps):
            self._check_cancel()
            bucket = self.bucket_starts.get(i)
            if bucket is not None:
                self._next_bucket(self.buckets[bucket])
            full = False
            limit = group_limit(
                self.posts,
                self.schedule.bytes_after[i],
                self.cfg.bucket_bytes,
                self.cfg.num_channels,
            )
            for m, io in self.resolved.pop(i, step):
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
            if full:
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

    def _follow(self, channel: int, handles: tuple[object, ...]) -> None:
        """Order the channel's next work (this message's packing or receive, on the device)
        after the groups that last used its staging space. The channel's pending group is
        posted first, so that none of its messages waits too: every device-side wait then
        points from a message to groups of messages before it in the schedule's global
        order, which both ends share, and the earliest unfinished message can always
        complete (no cycle through the peer). Every other channel's pending group is posted
        with it, never this one alone: its unpacking is launched right after posting, and
        launching needs what is posted to be a prefix of that order (`_flush_all`)."""
        self._flush_all()
        self.t.order_after(channel, [h for h in handles if isinstance(h, Handle)])

    def _flush_all(self) -> None:
        """Post every channel's pending group: first every channel's packing, then every
        channel's NCCL group, then the work after them (unpacking, checksums).

        What this rank has posted is then always a prefix of the schedule's global order,
        whenever it launches anything. A launch can block the host until the device is idle
        (CUDA's lazy loading of a kernel's module on its first launch; a full launch queue);
        the receives and sends in flight then finish only if the peer posts their
        counterparts without waiting for this rank. Posted as a prefix, they have: the peer
        posts everything before it waits, and what it waits for is earlier in the shared order.
        Posting one channel's group alone, or unpacking it before the next channel's group is
        posted, breaks that: on 2xH100 the first FP8 Qwen3-30B-A3B refit with experts in place
        waited forever at four channels (one channel committed), the receiver's host inside
        the first launch of a uint8 copy kernel, the sender waiting for its oldest send."""
        groups = [(ch, g) for ch in sorted(self.pending) if (g := self.pending.pop(ch)).ops]
        self.posts += bool(groups)
        for channel, group in groups:
            self._pack(channel, group)
        handles = [self._post(channel, group) for channel, group in groups]
        for (channel, group), handle in zip(groups, handles, strict=True):
            self._after_post(channel, group, handle)

    def _pack(self, channel: int, group: OpGroup) -> None:
        t0 = time.perf_counter()
        if self.delta is not None:
            with self.t.channel_context(channel):
                self.delta.before_send(group.messages)
        # Set before posting: a failure while posting may follow a receive already posted.
        self.receives_posted |= any(not op.send for op in group.ops)
        if group.pack_dst or group.pack_tables:
            with self.t.channel_context(channel):
                if group.pack_dst:
                    torch._foreach_copy_(group.pack_dst, group.pack_src)
                for table, buf, sums in group.pack_tables:
                    launch_copy(table, buf, scatter=False, sums=sums)
            group.pack_dst, group.pack_src, group.pack_tables = [], [], []
            self.report.host_pack_seconds += time.perf_counter() - t0

    def _post(self, channel: int, group: OpGroup) -> Handle:
        t0 = time.perf_counter()
        settled = self.t.settle_seconds
        try:
            handle = self.t.issue(channel, group.ops, self.deadline)
        except TransferError as exc:
            # Posting may read the peer's records (CUDA IPC): name the tensors too.
            raise type(exc)(f"{exc.message}; posting {group.describe(self.rank)}") from exc
        self.report.host_post_seconds += time.perf_counter() - t0
        self.report.host_settle_seconds += self.t.settle_seconds - settled
        if not self.report.first_post_seconds:
            self.report.first_post_seconds = time.monotonic() - self.started
        return handle

    def _after_post(self, channel: int, group: OpGroup, handle: Handle) -> None:
        t1 = time.perf_counter()
        if self.t.device_ordered:
            # A group that only sends checksums what it packed (or its parameters) while
            # the transfer runs: its staging slices come back as soon as the sends are done.
            receives = any(not op.send for op in group.ops)
            with self.t.beside(channel, after_transfer=receives):
                self._after_transfer(group)
            handle = self.t.fence(handle)
            if self.t.device_reuse:
                # Its staging slices come back now: their next users follow `handle` on the
                # device (`_follow`), so the host never waits for staging space.
                for token in group.slices:
                    self.ring.release(token, after=handle)
                group.slices = []
            self.report.host_after_seconds += time.perf_counter() - t1
        elif (
            group.unpack_dst
            or group.unpack_strided
            or group.unpack_tables
            or group.sum_bufs
            or group.delta_apply
        ):
            group.post = lambda: self._after_transfer(group)
        group.handle = handle
        group.ops = []
        self.in_flight.append(group)
        self.report.groups += 1

    def _complete_oldest(self) -> None:
        if not self.in_flight:
            raise TransferError(f"rank {self.rank}: staging exhausted with nothing in flight")
        group = self.in_flight.popleft()
        assert group.handle is not None
        t0 = time.perf_counter()
        try:
            self.t.wait(group.handle, self.deadline, self.cancel)
            self.report.host_wait_seconds += time.perf_counter() - t0
        except TransferTimeout as exc:
            raise TransferTimeout(
                f"{exc}; waiting for {group.describe(self.rank)}; {len(self.in_flight)} later group(s) "
                f"in flight, {self.ring.live} staging slice(s) held"
            ) from exc
        self._finish(group)

    def _retire_completed(self) -> None:
        while self.in_flight:
            handle = self.in_flight[0].handle
            if handle is None or not self.t.poll(handle):
                return
            self._complete_oldest()

    def _finish(self, group: OpGroup) -> None:
        if group.post is not None:
            group.post()
        for token in group.slices:
            self.ring.release(token)
        self.done += group.payload
        if self.progress is not None:
            self.progress(self.done, self.total)

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TransferError(f"rank {self.rank}: transfer cancelled")
        if time.monotonic() > self.deadline:
            raise TransferTimeout(f"rank {self.rank}: transfer deadline passed")

    # -- packing, unpacking, checksums -----------------------------------------------------------

    def _after_transfer(self, group: OpGroup) -> None:
        if self.delta is not None:
            self.delta.apply_all(group.delta_apply)
        if group.unpack_dst:
            torch._foreach_copy_(group.unpack_dst, group.unpack_src)
        for table, buf in group.unpack_tables:
            launch_copy(table, buf, scatter=True)
        for part, chunk in group.unpack_strided:
            chunk.view.copy_(chunk.typed(part))
        if group.sum_bufs:
            accumulate_sums_many(group.sum_bufs, group.sum_rows, tables=self.tables)
