"""The in-memory state of the refit being driven: who takes part, what each reported, and
the one wait primitive every phase uses (bounded, and cut short by any failure)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from refitplane.coordinator.core.failures import Reason, RefitFailed, list_some
from refitplane.coordinator.core.records import MemberRecord, RefitRecord
from refitplane.coordinator.core.waits import wait_event
from refitplane.protocol import RefitState, Role
from refitplane.protocol import messages as msg
from refitplane.protocol.models import RankProgress
from refitplane.reshard.plan import RankPlan


@dataclass
class Participant:
    member: MemberRecord
    # -1 for sidecars (not in the group)
    group_rank: int

    @property
    def data_plane(self) -> bool:
        return self.member.role.is_data_plane


@dataclass
class RefitRun:
    record: RefitRecord
    participants: dict[str, Participant] = field(default_factory=dict)
    # Everyone this refit involves (participants and the group's other members), for messages
    members: dict[str, MemberRecord] = field(default_factory=dict)
    # replica id → the member ids of its data-plane ranks / its sidecar
    replica_ranks: dict[str, list[str]] = field(default_factory=dict)
    replica_sidecar: dict[str, str] = field(default_factory=dict)
    # Group formation of this refit (0: none in progress)
    forming_epoch: int = 0
    forming_members: list[str] = field(default_factory=list)
    rendezvous: bytes | None = None
    joined: set[str] = field(default_factory=set)
    # PrepareRefit of data-plane participants: each one's rank plan (sent again, with its
    # body, to a member that reports PlanMissing), the group epoch it runs in, and how many
    # times each member was sent the body again in this refit.
    rank_plans: dict[str, RankPlan] = field(default_factory=dict)
    # Delta refits: each data-plane member's peers that exchange a delta, and the base.
    delta_peers: dict[str, frozenset[int]] = field(default_factory=dict)
    delta_base_version: int = 0
    prepare_epoch: int = 0
    plan_resends: dict[str, int] = field(default_factory=dict)
    # Reports
    prepared: set[str] = field(default_factory=set)
    done: dict[str, msg.TransferDone] = field(default_factory=dict)
    replica_updated: dict[str, int] = field(default_factory=dict)
    weights_modified: set[str] = field(default_factory=set)
    # PrepareRefit went out: participants hold state for this refit and need an abort.
    commands_sent: bool = False
    # StartTransfer went out: target replicas' weights may change from here on.
    transfer_started: bool = False
    failure: RefitFailed | None = None
    cancelled: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    dirty: bool = False
    last_flush: float = 0.0
    # Totals over generator ranks (bytes received, tensors verified / received)
    received: int = 0
    verified: int = 0
    tensors: int = 0

    @property
    def refit_id(self) -> str:
        return self.record.refit_id

    def touch(self) -> None:
        self.changed.set()

    def fail(self, reason: str, message: str) -> None:
        """First failure wins; the driver turns it into FAILED (or CANCELLED)."""
        if self.failure is None:
            self.failure = RefitFailed(reason, message)
        self.touch()

    def cancel(self) -> None:
        self.cancelled = True
        self.fail(Reason.CANCELLED, "cancelled by request")

    def data_members(self) -> list[str]:
        return [i for i, p in self.participants.items() if p.data_plane]

    def describe(self, member_ids: list[str]) -> str:
        return list_some(
            [self.members[i].describe() if i in self.members else i for i in member_ids]
        )

    def replica_of(self, member_id: str) -> str:
        p = self.participants.get(member_id)
        return p.member.replica_id if p is not None and p.member.role is not Role.TRAINER else ""

    # --- progress ----------------------------------------------------------------------

    def set_progress(
        self,
        member_id: str,
        *,
        sent: int,
        received: int,
        total: int,
        verified: int | None = None,
        tensors: int | None = None,
    ) -> None:
        old = self.record.ranks.get(member_id) or RankProgress(member_id=member_id)
        ranks = dict(self.record.ranks)
        ranks[member_id] = RankProgress(
            member_id=member_id,
            bytes_sent=max(old.bytes_sent, sent),
            bytes_received=max(old.bytes_received, received),
            bytes_total=total or old.bytes_total,
            tensors_verified=old.tensors_verified if verified is None else verified,
            tensors_total=old.tensors_total if tensors is None else tensors,
        )
        update: dict[str, object] = {"ranks": ranks, "updated_unix": time.time()}
        if self._receives(member_id):
            # Running totals over receivers, moved by this member's change only (a refit with
            # n ranks gets O(n) reports; re-summing every rank each time would be O(n²)).
            new = ranks[member_id]
            self.received += new.bytes_received - old.bytes_received
            self.verified += new.tensors_verified - old.tensors_verified
            self.tensors += new.tensors_total - old.tensors_total
            update |= {
                "bytes_done": min(self.record.bytes_total or 1 << 62, self.received),
                "tensors_verified": self.verified,
                "tensors_total": self.tensors,
            }
        self.record = self.record.model_copy(update=update)
        self.dirty = True
        self.touch()

    def _receives(self, member_id: str) -> bool:
        p = self.participants.get(member_id)
        return p is not None and p.member.role is Role.GENERATOR

    # --- waiting -----------------------------------------------------------------------

    async def wait_until(
        self,
        done: Callable[[], bool],
        *,
        timeout_s: float,
        on_timeout: Callable[[], RefitFailed],
        tick: Callable[[], Awaitable[None]] | None = None,
        tick_s: float = 0.5,
    ) -> None:
        """Wait until `done()`; raise the run's failure as soon as there is one, or
        `on_timeout()` after `timeout_s`. `tick` runs at least every `tick_s` (flushes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            # Clear before checking so a report landing in between still wakes the wait.
            self.changed.clear()
            if tick is not None:
                await tick()
            if self.failure is not None:
                raise self.failure
            if done():
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise on_timeout()
            await wait_event(self.changed, min(remaining, tick_s))


def phase_seconds(record: RefitRecord, now: float) -> dict[RefitState, float]:
    """Timings with the phase in progress closed at `now`."""
    timings = dict(record.timings)
    timings[record.state] = timings.get(record.state, 0.0) + max(
        0.0, now - record.phase_started_unix
    )
    return timings
