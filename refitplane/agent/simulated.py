"""A simulated agent: a `CommandHandler` with no data plane that answers every command at
once (rank 0 hands out a fake rendezvous, transfers "move" the plan's bytes instantly and
verify every tensor, sidecars report the new version). For tests, benchmarks and demos of
the control plane; knobs make it fail, stall or hold a transfer until aborted.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from refitplane.agent.handler import NullHandler
from refitplane.agent.plan_cache import DEFAULT_CAPACITY, HeldPlan, RankPlanCache
from refitplane.agent.session import AgentSession
from refitplane.errors import TransferError
from refitplane.protocol import Role
from refitplane.protocol.messages import (
    AbortRefitCmd,
    CommandBody,
    CreateRendezvousCmd,
    HopStamps,
    JoinGroupCmd,
    LeaveGroupCmd,
    PrepareRefitCmd,
    StartTransferCmd,
)


class SimulatedFailure(TransferError):
    """What a simulated agent raises when told to fail a command."""

    def __init__(self, reason: str, message: str, *, weights_modified: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.weights_modified = weights_modified


@dataclass
class Behaviour:
    """Per-command knobs, keyed by command name (`create_rendezvous`, `join_group`,
    `prepare_refit`, `start_transfer`)."""

    # Raise a failure (reason, message, weights_modified) instead of answering.
    fail: Mapping[str, tuple[str, str, bool]] = field(default_factory=dict)
    # Answer nothing (the coordinator's timeout must end the refit).
    silent: frozenset[str] = frozenset()
    # Sleep before answering.
    delay_s: Mapping[str, float] = field(default_factory=dict)
    # start_transfer: wait (bounded) until the refit is aborted instead of finishing.
    hold_transfer_s: float = 0.0
    # start_transfer: how long the simulated executor runs (a sleep between its hop stamps).
    executor_s: float = 0.0
    # start_transfer: report Progress halfway (real ranks send none in a transfer's first
    # 0.5 s: benchmarks of the report path turn it off).
    progress: bool = True


class SimulatedAgent(NullHandler):
    def __init__(
        self,
        role: Role,
        behaviour: Behaviour | None = None,
        *,
        plan_cache_size: int = DEFAULT_CAPACITY,
    ) -> None:
        self.role = role
        self.behaviour = behaviour or Behaviour()
        # Data-plane roles keep their plans as real ranks do (sidecars get none).
        self.plans = RankPlanCache(plan_cache_size)
        self.session: AgentSession | None = None
        self.commands: list[CommandBody] = []
        self.aborted_now: list[AbortRefitCmd | LeaveGroupCmd] = []
        self.epoch = 0
        self.group_rank = -1
        self._plans: dict[str, HeldPlan] = {}
        self._aborts: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    # --- helpers -------------------------------------------------------------------------

    def _s(self) -> AgentSession:
        if self.session is None:
            raise RuntimeError("SimulatedAgent.session is not set")
        return self.session

    def _begin(self, name: str, cmd: CommandBody) -> bool:
        """Record the command and apply the knobs; False: stay silent."""
        with self._lock:
            self.commands.append(cmd)
        b = self.behaviour
        if name in b.delay_s:
            time.sleep(b.delay_s[name])
        if name in b.fail:
            reason, message, modified = b.fail[name]
            raise SimulatedFailure(reason, message, weights_modified=modified)
        return name not in b.silent

    def received(self, kind: type) -> list[CommandBody]:
        with self._lock:
            return [c for c in self.commands if isinstance(c, kind)]

    # --- commands ------------------------------------------------------------------------

    def on_create_rendezvous(self, cmd: CreateRendezvousCmd) -> None:
        if self._begin("create_rendezvous", cmd):
            blob = f"sim-rendezvous:{cmd.epoch}:{cmd.backend.value}:{cmd.group_size}".encode()
            self._s().report_rendezvous_ready(cmd.epoch, blob)

    def on_join_group(self, cmd: JoinGroupCmd) -> None:
        if self._begin("join_group", cmd):
            self.epoch, self.group_rank = cmd.epoch, cmd.group_rank
            self._s().report_group_joined(cmd.epoch)

    def on_leave_group(self, cmd: LeaveGroupCmd) -> None:
        self._begin("leave_group", cmd)
        if cmd.epoch == self.epoch:
            self.epoch, self.group_rank = 0, -1

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        with self._lock:
            self._aborts.setdefault(cmd.refit_id, threading.Event())
        if not self._begin("prepare_refit", cmd):
            return
        if self.role.is_data_plane:
            held = self.plans.resolve(cmd)
            if held is None:
                self._s().report_plan_missing(
                    cmd.refit_id, cmd.plan_digest, cmd.plan_rank, self.plans.missing_message(cmd)
                )
                return
            with self._lock:
                self._plans[cmd.refit_id] = held
        self._s().report_prepared(cmd.refit_id)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        seen_ns = time.time_ns()
        if not self._begin("start_transfer", cmd):
            return
        s = self._s()
        if self.behaviour.hold_transfer_s:
            with self._lock:
                aborted = self._aborts.setdefault(cmd.refit_id, threading.Event())
            if aborted.wait(self.behaviour.hold_transfer_s):
                return
        if self.role is Role.GENERATOR_SIDECAR:
            s.report_replica_updated(cmd.refit_id, cmd.version)
            return
        with self._lock:
            held = self._plans.pop(cmd.refit_id, None)
        sent = held.send_bytes if held is not None else 0
        received = held.recv_bytes if held is not None else 0
        tensors = held.tensors_received if held is not None else 0
        total = sent + received
        executor_start_ns = time.time_ns()
        if self.behaviour.executor_s:
            time.sleep(self.behaviour.executor_s)
        hops = HopStamps(seen_ns, executor_start_ns, time.time_ns())
        if total and self.behaviour.progress:
            s.report_progress(
                cmd.refit_id, bytes_sent=sent // 2, bytes_received=received // 2, bytes_total=total
            )
        s.report_transfer_done(
            cmd.refit_id,
            bytes_sent=sent,
            bytes_received=received,
            seconds=0.001,
            tensors_verified=tensors,
            tensors_total=tensors,
            hops=dataclasses.replace(hops, sent_ns=time.time_ns()),
        )

    def on_abort_refit(self, cmd: AbortRefitCmd) -> None:
        with self._lock:
            self.commands.append(cmd)

    def on_abort_now(self, cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        with self._lock:
            self.aborted_now.append(cmd)
            if isinstance(cmd, AbortRefitCmd):
                self._aborts.setdefault(cmd.refit_id, threading.Event()).set()
