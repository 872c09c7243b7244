"""The executor: runs one rank's part of a plan over a transport, in place, verified.

The rank walks its messages in schedule order (see `schedule.py`), batching each
channel's consecutive messages into one group of sends/receives (posted once it holds a
few buckets' worth, and always before any wait). A message whose local memory is one
contiguous span (a single chunk, or a fused run of chunks lying back to back, e.g. 64 MoE
experts in vLLM's `w13`: `runs.py`, `message_io.py`) goes straight from/to that memory;
anything else is packed into (or unpacked from) a slice of the bounded staging ring. On
CUDA, a message whose chunks are all flat is packed or unpacked by one kernel launch over
a chunk table made when the plan was prepared (`chunk_copy.py`: no per-tensor host work);
otherwise a group's flat chunks go in one `torch._foreach_copy_` per direction and strided
ones one copy each, so hundreds of small tensors cost a few launches, not hundreds.
When the ring is full, everything pending is posted and the oldest group completed first,
so staging memory never exceeds the ring, which is sized when the plan is prepared to what
its packed messages take, within `max_inflight_bytes` (less a staged receiver's arena;
`prepared_plan.staging_room`) and reserved before the first op; over NCCL a posted group gives its
staging slices back at once and their next users wait for it on the device, not the host
(`staging.py`), so a sender packing thousands of expert tensors is never paced by its host
loop noticing that a send finished. On GPU, packing, the transfer and unpacking are ordered on
the channel's CUDA stream without host waits; on CPU (Gloo) unpacking happens when a group
completes.

Nothing in the posting loop allocates device or page-locked memory (CUDA serializes all
streams around such allocations, and a rank whose next NCCL group cannot start while an
earlier one waits for a peer can deadlock with it): the staging ring, the checksum tables
and the checksum kernel's launch tables are all in place before the first byte moves.
(One exception: a direct message whose parameter view starts off an 8-byte boundary is
checksummed by the torch path, which allocates temporaries; staged messages never are.)
The schedule and resolved views are kept for the next refit while plan and shards (or the
memory behind them) stay the same.

A receiver whose registry is a `StagedShards` (tensors it stages and applies itself: a
vLLM worker whose kernels repack their weights) gets its staged tensors a bucket of stages
at a time (`staged.py`): the schedule goes stage by stage, and at each bucket boundary the
rank completes everything in flight, then the owner applies the finished bucket (its bytes
are in place and checksummed) and the next one is given memory. Only there, with nothing
in flight, is staging memory touched, and the messages of a bucket are resolved against it
each time (their memory is new every refit). The last bucket is left for the owner to apply
after the transfer verified. A boundary waits on nothing from peers: they block in their
next transfer until this rank posts again.

With verification on, both ends checksum every message (the sender what it sends, the
receiver what arrived: its parameters themselves for direct messages; one kernel launch
per group of messages) and, after the last message, senders ship their checksum vectors;
a receiver raises `ChecksumMismatch` naming the sender, tensors and boxes before anyone
reports success. Any error aborts the transport: the group must be rebuilt before the next
refit.

A rank may arm its run at PrepareRefit (`arm`, the agent does after reporting prepared):
the run is built and everything before its first post that needs no peer is done then
(`TransferRun.arm`), so that StartTransfer goes straight to posting. The shards armed with are
the ones the run uses: from PrepareRefit a rank's weights are held (a trainer's read-lock, a
paused engine). Staged receivers, delta runs and link copies are built at the start.

The pieces: `prepared_plan` (a plan's schedule and resolved views, kept between refits),
`transfer_run` (one execution: the posting loop, staged buckets, deltas; armed or not),
`group_posting` (its channels' groups posted, completed and followed by their unpacking and
checksums), `run_checksums`
(its checksum tables, swapped and compared at the end), `op_group` (one channel's batch of
ops and copies) and `transfer_report` (what a run did).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

from refitplane.errors import InvalidArgument
from refitplane.reshard import delta_cost
from refitplane.reshard.checksum import LaunchTables
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.delta_cost import link_rate_setting
from refitplane.reshard.delta_exchange import DeltaLinks
from refitplane.reshard.message_io import resolve_messages, with_copy_tables
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.profiling import transfer_profile, write_report
from refitplane.reshard.schedule import rank_schedule
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.staged import StagedBucket, StagedShards
from refitplane.reshard.staging import StagingRing
from refitplane.reshard.transport.base import Transport

if TYPE_CHECKING:
    from refitplane.reshard.ipc_run import LinkCopies
    from refitplane.reshard.transport.cuda_ipc import CudaIpcTransport
from refitplane.reshard.prepared_plan import (
    PreparedPlan,
    bucket_steps,
    packed_sizes,
    staging_room,
)
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transfer_run import TransferRun

if TYPE_CHECKING:
    from refitplane.reshard.transfer_report import ProgressFn


def link_copies_enabled() -> bool:
    from refitplane.reshard.ipc_run import ENABLED

    return ENABLED


@dataclass(frozen=True)
class ArmedRun:
    """A run armed at PrepareRefit for refit `key`, waiting for its start."""

    key: str
    plan: RankPlan
    shards: LocalShards
    run: TransferRun
    seconds: float


class Executor:
    """Runs plans on one transport; keeps its staging arena across refits."""

    def __init__(self, transport: Transport, config: TransferConfig) -> None:
        if config.num_channels > transport.num_channels:
            raise InvalidArgument(
                f"config asks for {config.num_channels} channels, the group has "
                f"{transport.num_channels}",
                field="num_channels",
            )
        self.transport = transport
        self.config = config
        # Sized for each plan when it is prepared (`prepared_plan.staging_room`), reused
        # while that size stays the same.
        self.ring = StagingRing(0, transport.device)
        # Whether the last run posted a receive into destination memory: from then on its
        # bytes may change (they land as they arrive), whatever the run's outcome.
        self.receives_posted = False
        self._prepared: PreparedPlan | None = None
        # Link copies (`ipc_run.py`): the links of the prepared plan, kept with it. Sums are
        # taken from the agent's command thread (PrepareRefit) or a trainer's step.
        self._links: LinkCopies | None = None
        self._presum_lock = threading.Lock()
        self._armed: ArmedRun | None = None

    def arm(self, key: str, plan: RankPlan, shards: LocalShards) -> ArmedRun | None:
        """Build refit `key`'s run now, up to its first post (`TransferRun.arm`), for `run`
        to start when the start comes; None where it is not armed (staged receivers and
        link copies build at the start). Nothing is posted or launched: dropping an armed
        run (`disarm`, a later `arm`) leaves nothing behind."""
        self._armed = None
        if isinstance(shards, StagedShards) or (
            self.transport.copies_links and link_copies_enabled()
        ):
            return None
        began = time.monotonic()
        prepared = self._prepare_with_ring(plan, shards)
        run = self._new_run(prepared, None, None, began, None, None)
        run.arm()
        self._armed = ArmedRun(key, plan, shards, run, time.monotonic() - began)
        return self._armed

    def armed_shards(self, key: str) -> LocalShards | None:
        """The shards refit `key` was armed with (None: not armed)."""
        armed = self._armed
        return armed.shards if armed is not None and armed.key == key else None

    def disarm(self) -> None:
        self._armed = None

    def _new_run(
        self,
        prepared: PreparedPlan,
        progress: ProgressFn | None,
        cancel: threading.Event | None,
        started: float,
        staged: StagedShards | None,
        delta: DeltaLinks | None,
    ) -> TransferRun:
        return TransferRun(
            self.transport,
            self.config,
            self.ring,
            prepared,
            progress,
            cancel,
            started,
            staged,
            self._rated(delta),
            never_pays=delta_cost.never_pays(self._link_rate()),
        )

    def run(
        self,
        plan: RankPlan,
        shards: LocalShards,
        *,
        progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        delta: DeltaLinks | None = None,
        armed: str = "",
    ) -> TransferReport:
        """`delta`: the links that exchange deltas against a base version (`delta_exchange`);
        None or no peers: every message in full. `armed`: the refit whose run `arm` may have
        built for this plan and these shards (any other armed run is dropped)."""
        started = time.monotonic()
        self.receives_posted = False
        held, self._armed = self._armed, None
        if (
            held is not None
            and armed
            and held.key == armed
            and held.plan is plan
            and held.shards is shards
            and (delta is None or not delta.peers)
        ):
            held.run.start(progress, cancel, started)
            held.run.report.armed_seconds = held.seconds
            return self._execute(held.run, plan, None, started)
        prepared = self._prepare_with_ring(plan, shards)
        staged = shards if prepared.buckets and isinstance(shards, StagedShards) else None
        if staged is not None and len(prepared.buckets) > 1 and not self.config.verify_checksums:
            raise InvalidArgument(
                f"rank {plan.rank} applies staged weights a bucket at a time during the "
                "transfer, which needs checksums (verify_checksums / REFIT_VERIFY_CHECKSUMS)",
                field="verify_checksums",
            )
        if delta is not None and staged is not None and delta.peers:
            raise InvalidArgument(
                f"rank {plan.rank} stages its weights: it cannot apply a delta in place",
                field="delta_peers",
            )
        if self.transport.copies_links and link_copies_enabled():
            # Link copies only where every rank of the group can take them (staged
            # receivers and delta refits run messages): agreed once per group.
            can = staged is None and (delta is None or not delta.peers)
            deadline = started + self.config.timeout_s
            if cast("CudaIpcTransport", self.transport).link_copies(can, deadline):
                return self._run_links(prepared, progress, cancel, started)
        run = self._new_run(prepared, progress, cancel, started, staged, delta)
        return self._execute(run, plan, staged, started)

    def _execute(
        self, run: TransferRun, plan: RankPlan, staged: StagedShards | None, started: float
    ) -> TransferReport:
        run.report.prepared_seconds = time.monotonic() - started
        try:
            with transfer_profile(plan.rank):
                report = run.execute()
        except BaseException:
            self.receives_posted = run.receives_posted
            self.transport.abort()
            self.ring = StagingRing(self.ring.size, self.transport.device)
            if staged is not None:
                staged.discard()
            raise
        self.receives_posted = run.receives_posted
        report.seconds = time.monotonic() - started
        report.ring_peak_bytes = self.ring.peak
        report.staging_peak_bytes = report.ring_bytes + report.staged_peak_bytes
        self._measure(report)
        # With the rate this transfer may just have measured: a sender keeps a delta base
        # only where a later delta could pay.
        report.delta_base_needed = not delta_cost.never_pays(self._link_rate())
        write_report(plan.rank, report)
        if staged is not None:
            # A staged receiver holds no transfer memory between refits.
            self.ring.free()
        return report

    def presum_links(
        self,
        plan: RankPlan,
        shards: LocalShards,
        *,
        writes: int | None = None,
        after_step: bool = False,
    ) -> bool:
        """On a sender of a group that runs link copies (agreed at its first transfer),
        checksum the outgoing chunks now (`ipc_run.presum`): the transfer then only sends
        the sums. Called when a refit is prepared (the caller holds the weights from there
        to the end of the refit), and by trainers at the end of each optimizer step
        (`after_step`, inside the step's write hold) with `writes`, the weights' write count
        then: a PrepareRefit that passes the same count keeps those sums instead of reading
        the weights again during the prepare round. Returns whether sums are in place."""
        with self._presum_lock:
            links = self._links
            if (
                not after_step
                and writes is not None
                and links is not None
                and links.presummed
                and links.presummed_after_write == writes
                and self._prepared is not None
                and links.key is self._prepared
                and self._prepared.serves(plan, shards)
            ):
                return bool(links.outgoing)
            if links is not None:
                links.presummed = False  # sums of an earlier prepare describe nothing now
                links.presummed_after_write = None
            if not (
                self.transport.copies_links
                and link_copies_enabled()
                and self.config.verify_checksums
                and plan.send_bytes
                and not isinstance(shards, StagedShards)
                and cast("CudaIpcTransport", self.transport).agreed_link_copies
            ):
                return False
            from refitplane.reshard.ipc_run import PRESUM, LinkCopies, presum

            if not PRESUM:
                return False

            prepared = self._prepare(plan, shards)
            if self._links is None or self._links.key is not prepared:
                self._links = LinkCopies.build(prepared, prepared.steps, plan.rank)
            presum(
                cast("CudaIpcTransport", self.transport),
                self._links,
                self.config.max_inflight_bytes,
                writes if after_step else None,
            )
            return bool(self._links.outgoing)

    def _link_rate(self) -> float | None:
        """The rate this rank's "auto" decisions as a sender assume: REFIT_DELTA_LINK_GBPS if
        set ("off": 0.0, none), else the transport's measured `link_rate` (CUDA only: the
        cost model's figures are a GPU's, so a CPU rank has a rate only when it is set)."""
        rate = link_rate_setting()
        if rate is not None:
            return rate
        return self.transport.link_rate if self.transport.device.type == "cuda" else None

    def _rated(self, delta: DeltaLinks | None) -> DeltaLinks | None:
        """`delta` with the link rate its "auto" decisions assume, on senders (`_link_rate`),
        unless the caller gave one."""
        if delta is None or delta.link_bytes_per_s is not None or delta.base is None:
            return delta
        return replace(delta, link_bytes_per_s=self._link_rate())

    def _measure(self, report: TransferReport) -> None:
        """Keep the fastest rate a sender's mostly dense transfer moved its bytes at over
        its posting loop (`wire_seconds`: no connection, delta exchange or verification; a
        first transfer slowed by kernel loads only counts until a faster one)."""
        if self.transport.device.type != "cuda" or 2 * report.bytes_sent < report.bytes_full:
            return
        if report.bytes_sent and report.wire_seconds > 0:
            rate = report.bytes_sent / report.wire_seconds
            self.transport.link_rate = max(self.transport.link_rate or 0.0, rate)

    def _run_links(
        self,
        prepared: PreparedPlan,
        progress: ProgressFn | None,
        cancel: threading.Event | None,
        started: float,
    ) -> TransferReport:
        """The transport reads peers' memory itself (CUDA IPC): each link is one copy of all
        its chunks, straight between the two ends' tensors (`ipc_run.py`)."""
        from refitplane.reshard.ipc_run import LinkCopies, LinkCopyRun
        from refitplane.reshard.transport.cuda_ipc import CudaIpcTransport

        plan = prepared.plan
        if self._links is None or self._links.key is not prepared:
            self._links = LinkCopies.build(prepared, prepared.steps, plan.rank)
        report = TransferReport(tensors_total=prepared.tensors_received)
        report.prepared_seconds = time.monotonic() - started

        def receiving() -> None:
            self.receives_posted = True

        run = LinkCopyRun(
            cast(CudaIpcTransport, self.transport),
            self._links,
            rank=plan.rank,
            specs=dict(plan.specs),
            report=report,
            deadline=started + self.config.timeout_s,
            budget=self.config.max_inflight_bytes,
            verify=self.config.verify_checksums,
            cancel=cancel,
            on_receive=receiving,
        )
        try:
            # A trainer's step-end sums (`presum_links`) wait for the transfer: the two never
            # share the links' sum rows (they meet only after a refit's hold expired).
            with self._presum_lock, transfer_profile(plan.rank):
                run.execute()
        except BaseException:
            self._links = None
            self.transport.abort()
            raise
        if self.config.verify_checksums:
            report.tensors_verified = report.tensors_total
        report.seconds = report.posted_seconds = time.monotonic() - started
        if progress is not None:
            total = plan.send_bytes + plan.recv_bytes
            progress(total, total)
        write_report(plan.rank, report)
        return report

    def _prepare_with_ring(self, plan: RankPlan, shards: LocalShards) -> PreparedPlan:
        """`_prepare`, and the staging ring sized for the plan (a new one only where the
        size changed: the ring is kept between refits)."""
        prepared = self._prepare(plan, shards)
        if self.ring.size != prepared.ring_bytes:
            self.ring = StagingRing(prepared.ring_bytes, self.transport.device)
        return prepared

    def _prepare(self, plan: RankPlan, shards: LocalShards) -> PreparedPlan:
        kept = self._prepared
        if kept is not None and kept.serves(plan, shards):
            kept.shards, kept.shards_version = shards, shards.version  # next time: identity
            return kept
        self._prepared = None  # let go of the old views first
        schedule = rank_schedule(plan, self.config)
        deferred = shards.staged_names if isinstance(shards, StagedShards) else frozenset()
        steps = with_copy_tables(
            resolve_messages(plan, schedule, shards, deferred), self.transport.device
        )
        buckets: list[StagedBucket] = []
        arena: StagedBucket | None = None
        if isinstance(shards, StagedShards):
            buckets = shards.plan(schedule.receive_stages(plan.rank))
            if shards.layerwise and buckets:
                arena = max(buckets, key=lambda b: b.nbytes)
        spans = bucket_steps(schedule, buckets)
        # Before anything is kept: a plan whose staging cannot fit the budget is refused.
        ring_bytes, ring_room = staging_room(
            plan.rank, packed_sizes(plan, steps, shards, buckets, spans), self.config, arena
        )
        tables = None
        if self.config.verify_checksums and self.transport.device.type == "cuda":
            count = sum(len(step) for step in schedule.steps)
            tables = LaunchTables(self.transport.device, count)
        self._prepared = PreparedPlan(
            plan,
            shards,
            shards.version,
            shards.fingerprint(),
            schedule,
            steps,
            tables,
            tensors_received=plan.tensors_received,
            buckets=tuple(buckets),
            bucket_steps=tuple(spans),
            ring_bytes=ring_bytes,
            ring_room=ring_room,
        )
        return self._prepared
