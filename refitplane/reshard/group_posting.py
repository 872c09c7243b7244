"""The channels' groups of one execution (`GroupPosting`, the base of `transfer_run.TransferRun`):
every channel's pending group posted together (packing, the transport's group, the work
after it), groups in flight completed oldest first, and the unpacking and checksums of a
group queued behind its transfer (on the device where the transport orders work there, when
it completed otherwise).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from refitplane.errors import TransferError, TransferTimeout
from refitplane.reshard.checksum import LaunchTables, accumulate_sums_many
from refitplane.reshard.chunk_copy import launch as launch_copy
from refitplane.reshard.op_group import OpGroup
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import Handle

if TYPE_CHECKING:
    from refitplane.reshard.delta_exchange import DeltaExchange
    from refitplane.reshard.staging import StagingRing
    from refitplane.reshard.transfer_report import ProgressFn
    from refitplane.reshard.transport.base import Transport


class GroupPosting:
    """What `TransferRun` sets up in its `__init__`, and the posting of its groups."""

    t: Transport
    rank: int
    report: TransferReport
    ring: StagingRing
    delta: DeltaExchange | None
    tables: LaunchTables | None
    pending: dict[int, OpGroup]
    in_flight: deque[OpGroup]
    posts: int
    receives_posted: bool
    started: float
    deadline: float
    cancel: threading.Event | None
    progress: ProgressFn | None
    done: int
    total: int

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
            self.report.first_post_call_seconds = time.perf_counter() - t0
            self.report.first_post_settle_seconds = self.t.settle_seconds - settled
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
