"""A data-plane rank (trainer or generator): owns the group's transport and runs its part of
every refit. Trainer and generator agents subclass it and say where their shards live.

Group commands build and tear down the transport (Gloo on CPU, nccl4py on GPU); group rank
0 also creates each epoch's rendezvous. PrepareRefit names the rank's plan, which the rank
takes from its plan cache (the body comes only with the first refit of a plan; a plan no
longer cached is answered with PlanMissing and comes again with its body), so a steady
refit converts, schedules and resolves nothing (subclasses hook in: trainers take the
weights read-lock); after reporting prepared the rank arms its run (`Executor.arm`: built up
to its first post while the coordinator gathers the other ranks' reports and pushes the
start); StartTransfer runs the executor, unless the rank
receives on an external trigger (a vLLM worker receives when vLLM calls the engine), in
which case `run_transfer` is called from there. Abort cancels a running transfer at once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.agent.delta_keeping import DeltaBaseKeeping
from refitplane.agent.handler import NullHandler
from refitplane.agent.plan_cache import DEFAULT_CAPACITY, HeldPlan, RankPlanCache
from refitplane.agent.session import AgentSession
from refitplane.errors import FailedPrecondition, InvalidArgument, RefitError, TransferError
from refitplane.protocol import Backend
from refitplane.protocol.messages import (
    AbortRefitCmd,
    CreateRendezvousCmd,
    HopStamps,
    JoinGroupCmd,
    LeaveGroupCmd,
    PrepareRefitCmd,
    StartTransferCmd,
)
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.delta_base import DeltaSnapshot
from refitplane.reshard.executor import Executor
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import Transport

log = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 0.5

# REFIT_ARM_AT_PREPARE=0: build each run only when its StartTransfer comes (to compare; on
# 2xH100 a Qwen3-8B rank spent 0.8-1.0 ms from its start to its first post that way).
ARM_AT_PREPARE = os.environ.get("REFIT_ARM_AT_PREPARE", "1") != "0"


def placement_of(device: torch.device | str, node: str = "") -> tuple[str, str]:
    """(node, GPU UUID) a data-plane rank registers: `node` (REFIT_NODE; on Kubernetes the
    node's name from the downward API), else this host's name; the UUID of a CUDA device
    (empty on CPU). They decide which links may use CUDA IPC (`refitplane.protocol.links`)."""
    device = torch.device(device)
    uuid = ""
    if device.type == "cuda":
        from refitplane.reshard.transport.cuda_ipc import device_uuid

        uuid = device_uuid(device if device.index is not None else torch.cuda.current_device())
    return node or socket.gethostname(), uuid


def local_address() -> str:
    """This host's address, for peers to reach this process at when nothing names one
    (agents ask `AgentSettings.host`, REFIT_HOST, first)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True)
class Prepared:
    refit_id: str
    version: int
    epoch: int
    # With the plan's body filled in, whether it came with the command or from the cache.
    command: PrepareRefitCmd
    held: HeldPlan


class DataPlaneMember(DeltaBaseKeeping, NullHandler):
    """Handler of one data-plane rank. `shards` returns the rank's current registry."""

    def __init__(
        self,
        shards: Callable[[], LocalShards],
        *,
        device: torch.device,
        local_host: str = "127.0.0.1",
        run_on_start: bool = True,
        plan_cache_size: int = DEFAULT_CAPACITY,
        delta_snapshot: DeltaSnapshot | None = None,
    ) -> None:
        """`delta_snapshot`: senders that may send deltas keep the bytes of their last
        complete send in it (taken only while the refit config asks for deltas)."""
        self._shards = shards
        self.delta_snapshot = delta_snapshot
        self.plans = RankPlanCache(plan_cache_size)
        self.device = device
        self.local_host = local_host
        self.run_on_start = run_on_start
        self.session: AgentSession | None = None
        self.transport: Transport | None = None
        self.epoch = 0
        self._stores: dict[int, Any] = {}
        self._executor: Executor | None = None
        # The plan this rank last sent by over CUDA IPC: what a step's end checksums for.
        self._sent_plan: HeldPlan | None = None
        self._prepared: dict[str, Prepared] = {}
        self._ready = threading.Condition()
        # Held while a run is armed (`_arm`, the command thread): a start that comes on
        # another thread (a vLLM worker's update) takes the run once it is built.
        self._arming = threading.Lock()
        # Under `_ready`: transfers running now. None is armed meanwhile: an aborted one may
        # still be unwinding on vLLM's thread when the next refit is prepared, and arming
        # touches what a run uses (the executor's launch tables, the channels' streams).
        self._transferring = 0
        self._cancel = threading.Event()
        self.last_report: TransferReport | None = None
        self.transfers = 0
        # Under `_ready`: when each refit's StartTransfer reached this rank (`time.time_ns()`),
        # until its transfer runs: the first stamp of the hop timeline TransferDone carries.
        self._start_seen_ns: dict[str, int] = {}

    @property
    def ring_bytes_held(self) -> int:
        """The executor's staging ring held now: sized for the plan's packed messages and
        kept between refits, except by a receiver that stages its weights (freed after each)."""
        ring = self._executor.ring if self._executor is not None else None
        return ring.size if ring is not None and ring.allocated else 0

    def attach(self, session: AgentSession) -> None:
        self.session = session

    def _session(self) -> AgentSession:
        if self.session is None:
            raise FailedPrecondition("data-plane member used before attach(session)")
        return self.session

    # -- group --------------------------------------------------------------------------------

    def on_create_rendezvous(self, cmd: CreateRendezvousCmd) -> None:
        if cmd.backend in (Backend.GLOO, Backend.CUDA_IPC):
            # CUDA IPC's control messages go over Gloo: the same store.
            from refitplane.reshard.transport.gloo import create_gloo_rendezvous

            store, blob = create_gloo_rendezvous(self.local_host, cmd.group_size, timeout_s=300.0)
            self._stores = {cmd.epoch: store}  # the root keeps only the newest epoch's store
        elif cmd.backend == Backend.NCCL:
            from refitplane.reshard.transport.nccl import create_nccl_rendezvous

            blob = create_nccl_rendezvous(cmd.num_channels)
        else:
            raise InvalidArgument(f"unsupported backend {cmd.backend!r}", field="backend")
        self._session().report_rendezvous_ready(cmd.epoch, blob)

    def on_join_group(self, cmd: JoinGroupCmd) -> None:
        self._drop_transport(abort=True)
        if cmd.backend in (Backend.GLOO, Backend.CUDA_IPC):
            from refitplane.reshard.transport.gloo import GlooTransport

            gloo = GlooTransport(
                cmd.group_rank,
                cmd.group_size,
                cmd.rendezvous,
                num_channels=cmd.num_channels,
                timeout_s=cmd.timeout_s,
                local_host=self.local_host,
                store=self._stores.get(cmd.epoch),
                prefix=f"refit/epoch{cmd.epoch}",
            )
            self.transport = gloo
            if cmd.backend == Backend.CUDA_IPC:
                # Its control messages go over the Gloo group, its bytes through CUDA IPC.
                from refitplane.reshard.transport.cuda_ipc import CudaIpcTransport

                self.transport = CudaIpcTransport(gloo, device=self.device)
        elif cmd.backend == Backend.NCCL:
            from refitplane.reshard.transport.nccl import NcclTransport

            self.transport = NcclTransport(
                cmd.group_rank,
                cmd.group_size,
                cmd.rendezvous,
                device=self.device,
                num_channels=cmd.num_channels,
                timeout_s=cmd.timeout_s,
            )
        else:
            raise InvalidArgument(f"unsupported backend {cmd.backend!r}", field="backend")
        self.epoch = cmd.epoch
        self._session().report_group_joined(cmd.epoch)

    def on_leave_group(self, cmd: LeaveGroupCmd) -> None:
        if cmd.epoch >= self.epoch:
            self._drop_transport(abort=cmd.abort)

    def _drop_transport(self, *, abort: bool) -> None:
        transport, self.transport, self._executor = self.transport, None, None
        if transport is None:
            return
        try:
            if abort:
                transport.abort()
            else:
                transport.close()
        except RefitError as exc:
            log.warning("closing the transport of epoch %d: %s", self.epoch, exc.message)
        # A transport's communicators hold OS resources (a Gloo loop thread and sockets per
        # channel, the rendezvous store on group rank 0) that go only with the last Python
        # reference; one still caught in a reference cycle (a failed transfer's traceback)
        # would linger until the cyclic GC happens to run — 23 threads and 100 fds after
        # 400 rebuilds. Collect now: once per group epoch, not per refit.
        del transport
        gc.collect()

    # -- refits --------------------------------------------------------------------------------

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        if cmd.config is None or (cmd.plan is None and not cmd.plan_digest):
            raise InvalidArgument(
                "PrepareRefit for a data-plane rank needs a plan (its body or its digest) and "
                "a config",
                field="plan",
            )
        if cmd.epoch != self.epoch or self.transport is None:
            raise FailedPrecondition(
                f"refit {cmd.refit_id} is for group epoch {cmd.epoch}, this rank is in {self.epoch}"
            )
        self._check_delta_base(cmd)
        held = self.plans.resolve(cmd)
        if held is None:
            # Not a failure: the coordinator sends this command again with the body.
            message = self.plans.missing_message(cmd)
            log.info("refit %s: %s; asking for it", cmd.refit_id, message)
            self._session().report_plan_missing(
                cmd.refit_id, cmd.plan_digest, cmd.plan_rank, message
            )
            return
        if cmd.plan is not held.plan:
            # Hooks and the transfer see the body; the cached object is the one the
            # executor resolved its schedule and views for last time.
            cmd = dataclasses.replace(cmd, plan=held.plan)
        self._cancel.clear()
        self.before_transfer(cmd)
        if held.send_bytes and self.transport.copies_links and cmd.config is not None:
            # The weights are held from here (the trainer's read-lock): a sender over CUDA
            # IPC may checksum them now (REFIT_IPC_PRESUM), overlapping the coordinator's
            # prepare round (and a colocated vLLM's wake), not during the receivers' copies,
            # unless the last optimizer step's end took them and nothing wrote since.
            self._executor_for(cmd.config).presum_links(
                held.plan, self._shards(), writes=self.weight_writes()
            )
            self._sent_plan = held
        with self._ready:
            self._prepared[cmd.refit_id] = Prepared(cmd.refit_id, cmd.version, cmd.epoch, cmd, held)
            self._ready.notify_all()
        self._session().report_prepared(cmd.refit_id)
        self._arm(cmd)

    def _arm(self, cmd: PrepareRefitCmd) -> None:
        """After reporting prepared: build the run up to its first post (`Executor.arm`)
        while the coordinator gathers the other ranks' reports and pushes StartTransfer, so
        the start goes straight to posting. Where it cannot (a delta refit; a failure, logged)
        the start builds the run as before."""
        if not ARM_AT_PREPARE or cmd.config is None or cmd.plan is None:
            return
        with self._arming:
            with self._ready:
                if cmd.refit_id not in self._prepared or self._transferring:
                    return  # started (a vLLM worker's update), aborted, or another running
            shards = self._shards()
            if self._delta_links(cmd, shards) is not None:
                return
            try:
                self._executor_for(cmd.config).arm(cmd.refit_id, cmd.plan, shards)
            except (RefitError, RuntimeError) as exc:
                if self._executor is not None:
                    self._executor.disarm()
                log.warning("refit %s: arming the run failed: %s", cmd.refit_id, exc)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        self.start_seen(cmd.refit_id)
        if self.run_on_start:
            self.run_transfer(cmd.refit_id)

    def start_seen(self, refit_id: str) -> None:
        """Stamp when refit `refit_id`'s StartTransfer reached this rank (one refit at a
        time: an older refit's stamp is dropped)."""
        seen = time.time_ns()
        with self._ready:
            self._start_seen_ns = {refit_id: seen}

    def _wait_ready(
        self,
        ready: Callable[[], bool],
        timeout_s: float,
        timed_out: Callable[[], Exception],
        check: Callable[[], None] | None = None,
    ) -> None:
        """With `_ready` held: wait until `ready()`, at most `timeout_s`, then raise
        `timed_out()`; `check()` runs before each wait and may raise (an abort)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if check is not None:
                check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timed_out()
            self._ready.wait(remaining)

    def run_transfer(self, refit_id: str, *, wait_s: float = 0.0) -> TransferReport:
        """Run this rank's part of refit `refit_id` (prepared, or prepared within `wait_s`)."""
        waited = f" within {wait_s:g} s" if wait_s else ""
        with self._ready:
            self._wait_ready(
                lambda: refit_id in self._prepared,
                wait_s,
                lambda: FailedPrecondition(
                    f"refit {refit_id} was not prepared on this rank{waited}"
                ),
            )
            prepared = self._prepared.pop(refit_id)
            start_seen_ns = self._start_seen_ns.pop(refit_id, 0)
            self._transferring += 1
        try:
            return self._transfer(prepared, start_seen_ns)
        finally:
            with self._ready:
                self._transferring -= 1

    def _transfer(self, prepared: Prepared, start_seen_ns: int) -> TransferReport:
        refit_id = prepared.refit_id
        plan, config = prepared.held.plan, prepared.command.config
        assert config is not None
        session = self._session()
        received = [0]
        # Progress reports are synchronous round trips to the coordinator, made from the
        # transfer's own loop: none in the first _PROGRESS_EVERY_S and none at the end
        # (TransferDone follows at once with the totals), so a transfer shorter than that
        # makes none and the last group's completion goes straight on to verifying.
        last = [time.monotonic()]
        sent_side = prepared.held.send_bytes > 0

        def progress(done: int, total: int) -> None:
            received[0] = done
            now = time.monotonic()
            if now - last[0] >= _PROGRESS_EVERY_S and done < total:
                last[0] = now
                session.report_progress(
                    refit_id,
                    bytes_sent=done if sent_side else 0,
                    bytes_received=0 if sent_side else done,
                    bytes_total=total,
                )

        executor: Executor | None = None
        with self._arming:  # an arming under way ends first
            held = self._executor
            armed = held.armed_shards(refit_id) if held is not None else None
        shards = armed if armed is not None else self._shards()
        try:
            executor = self._executor_for(config)
            executor_start_ns = time.time_ns()
            report = executor.run(
                plan,
                shards,
                progress=progress,
                cancel=self._cancel,
                delta=self._delta_links(prepared.command, shards),
                armed=refit_id,
            )
            executor_end_ns = time.time_ns()
            # Still under the trainer's weights read-lock: the bytes are exactly those sent.
            sent = prepared.held.send_bytes > 0
            self._keep_delta_base(config, shards, report, sent=sent, version=prepared.version)
        except BaseException as exc:
            if self.delta_snapshot is not None:
                # The scan may have advanced the base part-way: it describes no version.
                self.delta_snapshot.invalidate()
            # A receiver that posted any receive no longer holds its old weights intact:
            # bytes land in the parameters as they arrive, long before a group completes
            # and progress counts them.
            posted = executor is not None and executor.receives_posted
            modified = bool(prepared.held.recv_bytes) and (received[0] > 0 or posted)
            exc.weights_modified = modified  # type: ignore[attr-defined]
            self._executor = None
            self.after_transfer(prepared, None, weights_modified=modified)
            raise
        self.after_transfer(prepared, report, weights_modified=bool(prepared.held.recv_bytes))
        self.last_report = report
        self.transfers += 1
        session.report_transfer_done(
            refit_id,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            seconds=report.seconds,
            tensors_verified=report.tensors_verified,
            tensors_total=report.tensors_total,
            bytes_full=report.bytes_full,
            delta_base_version=self.delta_snapshot.version if self.delta_snapshot else 0,
            hops=HopStamps(start_seen_ns, executor_start_ns, executor_end_ns, time.time_ns()),
        )
        return report

    def _executor_for(self, config: TransferConfig) -> Executor:
        if self.transport is None:
            raise TransferError("no communication group: the rank is not in a group epoch")
        if (
            self._executor is None
            or self._executor.config != config
            or self._executor.transport is not self.transport
        ):
            self._executor = Executor(self.transport, config)
        return self._executor

    def on_abort_now(self, cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        self._cancel.set()

    def on_abort_refit(self, cmd: AbortRefitCmd) -> None:
        with self._ready:
            prepared = self._prepared.pop(cmd.refit_id, None)
        with self._arming:
            if self._executor is not None and self._executor.armed_shards(cmd.refit_id) is not None:
                self._executor.disarm()
        if prepared is not None:
            self.after_transfer(prepared, None, weights_modified=False)

    # -- hooks ---------------------------------------------------------------------------------

    def before_transfer(self, cmd: PrepareRefitCmd) -> None:
        """Called when a refit is prepared (e.g. trainers take the weights read-lock)."""

    def weight_writes(self) -> int | None:
        """How many times the weights were opened for writing so far (trainers: optimizer
        steps), or None where the rank does not count them."""
        return None

    def presum_after_step(self, writes: int) -> bool:
        """At the end of an optimizer step (`writes`: its count), inside its write hold: on a
        sender whose last refit ran link copies over CUDA IPC, checksum the outgoing chunks
        now for the next refit, which then sends these sums instead of reading the weights
        during its prepare round. Never raises (training goes on); returns whether it did."""
        executor, held = self._executor, self._sent_plan
        if executor is None or held is None or executor.transport is not self.transport:
            return False
        try:
            return executor.presum_links(held.plan, self._shards(), writes=writes, after_step=True)
        except (RefitError, RuntimeError) as exc:  # the next PrepareRefit takes them then
            log.warning("checksums at the end of the step failed: %s", exc)
            return False

    def after_transfer(
        self, prepared: Prepared, report: TransferReport | None, *, weights_modified: bool
    ) -> None:
        """Called once the transfer ended (`report`), failed or was aborted (`None`);
        `weights_modified`: this rank's destination bytes changed (release what was taken)."""

    def close(self) -> None:
        self._cancel.set()
        self._drop_transport(abort=True)
        self._stores.clear()
