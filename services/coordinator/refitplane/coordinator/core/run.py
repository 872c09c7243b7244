"""The in-memory state of the refit being driven: who takes part (`cast.Cast`, fixed once it
is planned), what each reported, its progress totals, and the one wait primitive every phase
uses (bounded, and cut short by any failure).

Only the job's driver writes a `RefitRun`; cancel and reports only signal it. State that
other machines own lives with them: the group epoch being formed in `groups`, the rank plans
sent and resent in `plan_delivery`, the delta base chosen in `delta` (a frozen choice)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from refitplane.coordinator.core.cast import Cast
from refitplane.coordinator.core.delta import NO_DELTA, DeltaChoice
from refitplane.coordinator.core.failures import RefitFailed, list_some
from refitplane.coordinator.core.membership import Membership
from refitplane.coordinator.core.records import MemberRecord, RefitRecord
from refitplane.coordinator.core.waits import wait_event
from refitplane.protocol import Reason, RefitState, Role
from refitplane.protocol import messages as msg
from refitplane.protocol.models import RankProgress

# Progress is persisted at most this often (watchers see every change in memory).
FLUSH_INTERVAL_S = 0.5


@dataclass
class RefitRun:
    record: RefitRecord
    cast: Cast = field(default_factory=Cast)
    delta: DeltaChoice = NO_DELTA
    # Reports
    prepared: set[str] = field(default_factory=set)
    done: dict[str, msg.TransferDone] = field(default_factory=dict)
    replica_updated: dict[str, int] = field(default_factory=dict)
    weights_modified: set[str] = field(default_factory=set)
    # PrepareRefit went out: participants hold state for this refit and need an abort.
    commands_sent: bool = False
    failure: RefitFailed | None = None
    cancelled: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    # The record changed since it was last written, and when that was (monotonic)
    _dirty: bool = False
    _last_flush: float = 0.0
    # Target replicas whose sidecar was told RanksVerified
    _verified_told: set[str] = field(default_factory=set)
    # When each phase was entered, and the last report of each kind (member, when, the phase
    # it came in): which member each phase waited for last (`critical_path`, monotonic).
    _entered: dict[RefitState, float] = field(default_factory=dict)
    _last_report: dict[str, tuple[str, float, RefitState]] = field(default_factory=dict)
    # Totals over generator ranks (bytes received, tensors verified / received)
    _received: int = 0
    _verified: int = 0
    _tensors: int = 0

    @property
    def refit_id(self) -> str:
        return self.record.refit_id

    @property
    def transfer_started(self) -> bool:
        """StartTransfer went out: target replicas' weights may change from here on."""
        return self.record.state in (RefitState.TRANSFERRING, RefitState.VERIFYING)

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

    def describe(self, member_ids: list[str]) -> str:
        members = self.cast.members
        return list_some([members[i].describe() if i in members else i for i in member_ids])

    def check_alive(self, membership: Membership, member_ids: Iterable[str]) -> None:
        """Members may have left while the plan was built; fail now rather than time out."""
        for member_id in member_ids:
            member = membership.find(member_id)
            if member is None:
                who = self.describe([member_id])
                raise RefitFailed(Reason.MEMBER_LEFT, f"{who} is no longer registered")
            if not member.alive:
                raise RefitFailed(Reason.LEASE_EXPIRED, f"{member.describe()}: lease expired")

    def newly_settled(self) -> list[str]:
        """Target replicas not yet done that now hold the new version: a sidecar's replica
        once it reported the version, any other once every rank finished and verified all it
        received. Raises on a replica that cannot get there."""
        version = self.record.version
        cast = self.cast
        newly: list[str] = []
        for replica, rank_ids in cast.replica_ranks.items():
            if replica in self.record.replicas_done:
                continue
            updated = self.replica_updated.get(replica)
            if updated is not None and updated != version:
                raise RefitFailed(
                    Reason.VERSION_MISMATCH,
                    f"replica {replica!r} reported version {updated}, the refit is {version}",
                )
            if replica in cast.replica_sidecar:
                if updated == version:
                    newly.append(replica)
                continue
            if not all(i in self.done for i in rank_ids):
                continue
            short = [
                i for i in rank_ids if self.done[i].tensors_verified < self.done[i].tensors_total
            ]
            if short:
                raise RefitFailed(
                    Reason.VERIFY_FAILED,
                    f"replica {replica!r}: {self.describe(short)} verified fewer tensors than "
                    "they received",
                )
            newly.append(replica)
        return newly

    def ranks_verified(self, rank: MemberRecord) -> tuple[str, msg.RanksVerifiedCmd] | None:
        """Right after `rank`'s TransferDone was accepted: (its replica's sidecar, the command
        that tells it) when that made every rank of the replica verified (`fully_verified`,
        the rule a controller applies to the record) — once per replica; else None. The
        caller accepts reports only while the refit has not failed, so on the sidecar's
        stream this precedes any AbortRefit of the refit."""
        replica = rank.replica_id
        sidecar = self.cast.replica_sidecar.get(replica)
        ranks = self.cast.replica_ranks.get(replica, [])
        if (
            sidecar is None
            or not self.cast.waits_for_ranks_verified(sidecar)
            or replica in self._verified_told
            or rank.member_id not in ranks
        ):
            return None
        for member_id in ranks:
            done = self.done.get(member_id)
            if done is None or not done.fully_verified:
                return None
        self._verified_told.add(replica)
        return sidecar, msg.RanksVerifiedCmd(
            refit_id=self.refit_id, version=self.record.version, member_ids=frozenset(ranks)
        )

    # --- the record ----------------------------------------------------------------------

    def update(self, **changes: object) -> None:
        """Change the record in memory; `flush_due` says when to write it."""
        self.record = self.record.model_copy(update=changes)
        self._dirty = True

    def note(self, **changes: object) -> None:
        """Change the record in memory without asking for a write of its own: the change goes
        with the next one (a phase's entry). For the hop timeline's stamps: a write in the
        middle of TRANSFERRING would cost a store round trip per refit, and one landing on a
        store that just lost its state races the loss's detection."""
        self.record = self.record.model_copy(update=changes)

    def written(self, record: RefitRecord) -> None:
        """`record` was just written to the store; it is the run's record now."""
        if record.state not in self._entered:
            self._entered[record.state] = time.monotonic()
        self.record = record
        self._dirty = False
        self._last_flush = time.monotonic()

    def flush_due(self) -> bool:
        return self._dirty and time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S

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
        ranks[member_id] = old.model_copy(
            update={
                "bytes_sent": max(old.bytes_sent, sent),
                "bytes_received": max(old.bytes_received, received),
                "bytes_total": total or old.bytes_total,
                "tensors_verified": old.tensors_verified if verified is None else verified,
                "tensors_total": old.tensors_total if tensors is None else tensors,
            }
        )
        update: dict[str, object] = {"ranks": ranks, "updated_unix": time.time()}
        if self._receives(member_id):
            # Running totals over receivers, moved by this member's change only (a refit with
            # n ranks gets O(n) reports; re-summing every rank each time would be O(n²)).
            new = ranks[member_id]
            self._received += new.bytes_received - old.bytes_received
            self._verified += new.tensors_verified - old.tensors_verified
            self._tensors += new.tensors_total - old.tensors_total
            update |= {
                "bytes_done": min(self.record.bytes_total or 1 << 62, self._received),
                "tensors_verified": self._verified,
                "tensors_total": self._tensors,
            }
        self.update(**update)
        self.touch()

    def set_hops(self, member_id: str, hops: msg.HopStamps, recorded_ns: int) -> None:
        """Keep `member_id`'s hop timeline from its TransferDone with the record, and when
        the coordinator accepted that report (`recorded_ns`, its wall clock)."""
        old = self.record.ranks.get(member_id) or RankProgress(member_id=member_id)
        ranks = dict(self.record.ranks)
        ranks[member_id] = old.model_copy(
            update={
                "start_seen_ns": hops.start_seen_ns,
                "executor_start_ns": hops.executor_start_ns,
                "executor_end_ns": hops.executor_end_ns,
                "done_sent_ns": hops.sent_ns,
                "done_recorded_ns": recorded_ns,
            }
        )
        self.update(ranks=ranks)

    def _receives(self, member_id: str) -> bool:
        p = self.cast.participants.get(member_id)
        return p is not None and p.member.role is Role.GENERATOR

    def reported(self, kind: str, member_id: str) -> None:
        """An accepted report of `kind` (Prepared, TransferDone, ...) from `member_id`."""
        self._last_report[kind] = (member_id, time.monotonic(), self.record.state)

    def critical_path(self) -> str:
        """Which member's report each phase waited for last, and how far into the phase it
        came (ms), e.g. "Prepared: trainer rank 0 (...) +2.9 ms into PREPARING": where a
        refit's control time goes, one line per refit whatever the member count."""
        parts = []
        for kind, (member_id, when, state) in self._last_report.items():
            since = when - self._entered.get(state, when)
            parts.append(
                f"{kind}: {self.describe([member_id])} +{1e3 * since:.1f} ms into {state.value}"
            )
        return "; ".join(parts)

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
