"""The executor: runs one rank's part of a plan over a transport, in place, verified.

Per round of the schedule (see `schedule.py`) the rank posts one group of sends/receives
on the round's channel. A message that is a single chunk whose local view is contiguous
goes straight from/to parameter memory; anything else is packed into (or unpacked from) a
slice of the bounded staging ring. When the ring is full, the oldest group is completed
first, so staging memory never exceeds `max_inflight_bytes`. On GPU, packing, the
transfer and unpacking are ordered on the channel's CUDA stream without host waits; on
CPU (Gloo) unpacking happens when a group completes.

With verification on, both ends checksum every chunk (the sender what it sends, the
receiver what its parameters hold afterwards) and, after the last round, senders ship
their checksum vectors; a receiver raises `ChecksumMismatch` naming the tensor, box and
sender before anyone reports success. Any error aborts the transport: the group must be
rebuilt before the next refit.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refitplane.errors import ChecksumMismatch, LayoutError, TransferError
from refitplane.reshard.boxes import Box, box_shape, format_box
from refitplane.reshard.checksum import checksum
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.schedule import Message, RankSchedule, rank_schedule
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.staging import StagingRing
from refitplane.reshard.transport.base import Handle, P2POp, Transport

ProgressFn = Callable[[int, int], None]


@dataclass
class TransferReport:
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    messages: int = 0
    direct_messages: int = 0
    packed_messages: int = 0
    tensors_total: int = 0
    tensors_verified: int = 0
    staging_peak_bytes: int = 0
    # Received tensors: a digest of their chunk checksums. It depends on the bytes and on
    # how the plan and config cut them, so it compares refits of the same job, not jobs.
    tensor_digests: dict[str, str] = field(default_factory=dict)


@dataclass
class _Group:
    handle: Handle
    slices: int
    nbytes: int
    post: Callable[[], None] | None


Link = tuple[int, int]


class Executor:
    """Runs plans on one transport; keeps its staging arena across refits."""

    def __init__(self, transport: Transport, config: TransferConfig) -> None:
        self.transport = transport
        self.config = config
        self.ring = StagingRing(config.max_inflight_bytes, transport.device)

    def run(
        self,
        plan: RankPlan,
        shards: LocalShards,
        *,
        progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> TransferReport:
        started = time.monotonic()
        run = _Run(self, plan, shards, progress, cancel, started + self.config.timeout_s)
        try:
            report = run.execute()
        except BaseException:
            self.transport.abort()
            self.ring = StagingRing(self.config.max_inflight_bytes, self.transport.device)
            raise
        report.seconds = time.monotonic() - started
        report.staging_peak_bytes = self.ring.peak
        return report


class _Run:
    """State of one execution (kept out of `Executor` so nothing leaks between refits)."""

    def __init__(
        self,
        executor: Executor,
        plan: RankPlan,
        shards: LocalShards,
        progress: ProgressFn | None,
        cancel: threading.Event | None,
        deadline: float,
    ) -> None:
        self.t = executor.transport
        self.cfg = executor.config
        self.ring = executor.ring
        self.plan = plan
        self.rank = plan.rank
        self.progress = progress
        self.cancel = cancel
        self.deadline = deadline
        self.schedule: RankSchedule = rank_schedule(plan, self.cfg)
        self.views = self._resolve_views(shards)
        self.verify = self.cfg.verify_checksums
        self.sums: dict[Link, torch.Tensor] = {}
        if self.verify:
            for link, n in self.schedule.chunks_per_link.items():
                self.sums[link] = torch.zeros(n, dtype=torch.int64, device=self.t.device)
        self.outstanding: deque[_Group] = deque()
        self.report = TransferReport()
        self.total = plan.send_bytes + plan.recv_bytes
        self.done = 0
        self.report.tensors_total = len({p.tensor for link in plan.recvs for p in link.pieces})

    # -- preparation: every view resolved and checked before any byte moves ----------------

    def _resolve_views(self, shards: LocalShards) -> dict[Message, list[torch.Tensor]]:
        for name, spec in self.plan.specs.items():
            try:
                local = shards.spec(name)
            except KeyError:
                raise LayoutError(
                    f"the plan moves this tensor but rank {self.rank} registered no storage for it",
                    tensor=name,
                    rank=self.rank,
                ) from None
            if local != spec:
                raise LayoutError(
                    f"plan expects {list(spec.shape)} {spec.dtype}, rank {self.rank} holds "
                    f"{list(local.shape)} {local.dtype}",
                    tensor=name,
                    rank=self.rank,
                )
        views: dict[Message, list[torch.Tensor]] = {}
        for m in self.schedule.messages:
            views[m] = [shards.view(c.tensor, c.box) for c in m.chunks]
        return views

    # -- main loop ----------------------------------------------------------------------------

    def execute(self) -> TransferReport:
        self.t.begin()
        for round_msgs in self.schedule.rounds:
            self._check_cancel()
            self._run_round(round_msgs)
            self._retire_completed()
        while self.outstanding:
            self._complete_oldest()
        if self.verify:
            self._verify()
        self.t.end()
        return self.report

    def _run_round(self, msgs: tuple[Message, ...]) -> None:
        channel = msgs[0].channel
        ops: list[P2POp] = []
        posts: list[Callable[[], None]] = []
        slices = 0
        nbytes = 0
        for m in msgs:
            sending = m.src == self.rank
            views = self.views[m]
            direct = len(views) == 1 and views[0].is_contiguous()
            if direct:
                buf = views[0].reshape(-1).view(torch.uint8)
            else:
                taken = self.ring.try_take(m.nbytes)
                while taken is None:
                    if ops:
                        self._flush(channel, ops, posts, slices, nbytes)
                        ops, posts, slices, nbytes = [], [], 0, 0
                    self._complete_oldest()
                    taken = self.ring.try_take(m.nbytes)
                buf = taken
                slices += 1
            with self.t.channel_context(channel):
                if sending:
                    self._pack(m, views, buf, direct)
                else:
                    posts.append(self._unpacker(m, views, buf, direct))
            ops.append(P2POp(sending, m.dst if sending else m.src, buf))
            nbytes += m.nbytes
            self.report.messages += 1
            if direct:
                self.report.direct_messages += 1
            else:
                self.report.packed_messages += 1
            if sending:
                self.report.bytes_sent += sum(c.nbytes for c in m.chunks)
            else:
                self.report.bytes_received += sum(c.nbytes for c in m.chunks)
        if ops:
            self._flush(channel, ops, posts, slices, nbytes)

    def _flush(
        self,
        channel: int,
        ops: list[P2POp],
        posts: list[Callable[[], None]],
        slices: int,
        nbytes: int,
    ) -> None:
        handle = self.t.issue(channel, ops)
        post: Callable[[], None] | None = None
        if self.t.device_ordered:
            with self.t.channel_context(channel):
                for p in posts:
                    p()
            handle = self.t.fence(handle)
        elif posts:

            def post() -> None:
                for p in posts:
                    p()

        self.outstanding.append(_Group(handle, slices, nbytes, post))

    def _complete_oldest(self) -> None:
        if not self.outstanding:
            raise TransferError(f"rank {self.rank}: staging exhausted with nothing in flight")
        group = self.outstanding.popleft()
        self.t.wait(group.handle, self.deadline, self.cancel)
        self._finish(group)

    def _retire_completed(self) -> None:
        while self.outstanding and self.t.poll(self.outstanding[0].handle):
            group = self.outstanding.popleft()
            self.t.wait(group.handle, self.deadline, self.cancel)
            self._finish(group)

    def _finish(self, group: _Group) -> None:
        if group.post is not None:
            group.post()
        for _ in range(group.slices):
            self.ring.release_oldest()
        self.done += group.nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TransferError(f"rank {self.rank}: transfer cancelled")
        if time.monotonic() > self.deadline:
            raise TransferError(f"rank {self.rank}: transfer deadline passed")

    # -- packing, unpacking, checksums -----------------------------------------------------------

    def _typed(self, buf: torch.Tensor, tensor: str, box: Box) -> torch.Tensor:
        return buf.view(torch_dtype(self.plan.specs[tensor].dtype)).view(box_shape(box))

    def _pack(self, m: Message, views: list[torch.Tensor], buf: torch.Tensor, direct: bool) -> None:
        link = (m.src, m.dst)
        for chunk, view in zip(m.chunks, views, strict=True):
            part = buf if direct else buf[chunk.offset : chunk.offset + chunk.nbytes]
            if not direct:
                self._typed(part, chunk.tensor, chunk.box).copy_(view)
            if self.verify:
                self.sums[link][chunk.index] = checksum(part)

    def _unpacker(
        self, m: Message, views: list[torch.Tensor], buf: torch.Tensor, direct: bool
    ) -> Callable[[], None]:
        link = (m.src, m.dst)

        def unpack() -> None:
            for chunk, view in zip(m.chunks, views, strict=True):
                part = buf if direct else buf[chunk.offset : chunk.offset + chunk.nbytes]
                if not direct:
                    view.copy_(self._typed(part, chunk.tensor, chunk.box))
                if not self.verify:
                    continue
                if direct or view.is_contiguous():
                    landed = view.reshape(-1).view(torch.uint8)
                else:
                    # Read the parameter back so the checksum proves what it now holds.
                    self._typed(part, chunk.tensor, chunk.box).copy_(view)
                    landed = part
                self.sums[link][chunk.index] = checksum(landed)

        return unpack

    def _verify(self) -> None:
        # Order channel 0 after every channel's packing/unpacking, then swap vectors.
        self.t.end()
        self.t.begin()
        ops: list[P2POp] = []
        remote: dict[Link, torch.Tensor] = {}
        for link in sorted(self.sums):
            src, dst = link
            if src == self.rank:
                ops.append(P2POp(True, dst, self.sums[link].view(torch.uint8)))
            else:
                theirs = torch.empty_like(self.sums[link])
                remote[link] = theirs
                ops.append(P2POp(False, src, theirs.view(torch.uint8)))
        if ops:
            with self.t.channel_context(0):
                handle = self.t.fence(self.t.issue(0, ops))
            self.t.wait(handle, self.deadline, self.cancel)
        chunk_names = self._recv_chunk_names()
        per_tensor: dict[str, list[int]] = {}
        for link, theirs in sorted(remote.items()):
            mine = self.sums[link].cpu()
            theirs_cpu = theirs.cpu()
            bad = (mine != theirs_cpu).nonzero().flatten().tolist()
            if bad:
                tensor, box = chunk_names[link][bad[0]]
                raise ChecksumMismatch(
                    f"rank {self.rank}: tensor {tensor!r} box {format_box(box)} from rank {link[0]} "
                    f"does not match the sender's checksum ({len(bad)} mismatched chunk(s) on this link)"
                )
            for idx, value in enumerate(mine.tolist()):
                per_tensor.setdefault(chunk_names[link][idx][0], []).append(value)
        self.report.tensors_verified = len(per_tensor)
        for name, values in per_tensor.items():
            h = hashlib.sha256(repr(values).encode()).hexdigest()[:16]
            self.report.tensor_digests[name] = h

    def _recv_chunk_names(self) -> dict[Link, list[tuple[str, Box]]]:
        names: dict[Link, list[tuple[str, Box]]] = {}
        for m in self.schedule.messages:
            if m.dst == self.rank:
                entries = names.setdefault((m.src, m.dst), [])
                entries.extend((c.tensor, c.box) for c in m.chunks)
        return names
