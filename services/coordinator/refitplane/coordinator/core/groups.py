"""Group epochs of one job: the communicator its data-plane members share. An epoch is formed
on demand by the refit that needs one (group rank 0 creates the rendezvous, then every member
joins), reused while its members, backend and channel count stay the same, and poisoned when
they change or a member reports it broken (the next refit forms a new one)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from refitplane.coordinator.core.context import DriverContext
from refitplane.coordinator.core.failures import RefitFailed
from refitplane.coordinator.core.records import GroupRecord, GroupState, MemberRecord
from refitplane.coordinator.core.run import RefitRun
from refitplane.protocol import Backend, Reason
from refitplane.protocol import messages as msg

log = logging.getLogger(__name__)

# A rendezvous blob larger than this is refused (NCCL ids are 128 bytes per channel).
MAX_RENDEZVOUS_BYTES = 64 * 1024


@dataclass
class Formation:
    """An epoch a refit forms: its members in group-rank order, the rendezvous rank 0
    created, and who has joined. `open` while rendezvous and joins are awaited."""

    refit_id: str
    epoch: int
    members: list[str]
    rendezvous: bytes | None = None
    joined: set[str] = field(default_factory=set)
    open: bool = True


def is_group_report(report: msg.Report) -> bool:
    """About forming or keeping a group epoch rather than about a refit's progress."""
    body = report.body
    return isinstance(body, msg.RendezvousReady | msg.GroupJoined) or (
        isinstance(body, msg.Failure) and not report.refit_id
    )


class GroupEpochs:
    """The group epoch of one job; the only writer of its `GroupRecord`."""

    def __init__(self, job: str, ctx: DriverContext) -> None:
        self.job = job
        self._ctx = ctx
        self._s = ctx.settings
        self.record = GroupRecord(job=job)
        # The epoch the refit being driven formed (or is forming), if it formed one
        self._formation: Formation | None = None

    def load(self, record: GroupRecord) -> None:
        self.record = record

    def formed_by(self, run: RefitRun, member_id: str) -> bool:
        """`member_id` is a member of the epoch `run` formed or is forming."""
        f = self._formation
        return f is not None and f.refit_id == run.refit_id and member_id in f.members

    def reusable(self, member_ids: list[str], backend: Backend) -> GroupRecord | None:
        g = self.record
        if (
            g.state is GroupState.READY
            and g.members == member_ids
            and g.backend is backend
            and g.num_channels == self._s.num_channels
        ):
            return g
        return None

    async def form(
        self, run: RefitRun, members: list[MemberRecord], backend: Backend
    ) -> GroupRecord:
        """Form a new epoch of exactly these members (the current one cannot be reused)."""
        ids = [m.member_id for m in members]
        old = self.record
        new = GroupRecord(
            job=self.job,
            epoch=old.epoch + 1,
            state=GroupState.FORMING,
            backend=backend,
            members=ids,
            num_channels=self._s.num_channels,
        )
        await self._ctx.store.save_group(new)
        self.record = new
        self._ctx.metrics.epochs.inc()
        log.info(
            "job %s: group epoch %d (%s, %d ranks)", self.job, new.epoch, backend.value, new.size
        )
        if old.members and old.state is not GroupState.NONE:
            for member_id in old.members:
                member = self._ctx.membership.find(member_id)
                if member is not None and member.alive:
                    self._ctx.outbox.send(member_id, msg.LeaveGroupCmd(epoch=old.epoch, abort=True))
        forming = self._formation = Formation(run.refit_id, new.epoch, ids)
        timeout = self._s.group_timeout_s
        try:
            run.check_alive(self._ctx.membership, ids)
            self._ctx.outbox.send(
                ids[0],
                msg.CreateRendezvousCmd(
                    epoch=new.epoch,
                    backend=backend,
                    group_size=new.size,
                    num_channels=new.num_channels,
                ),
            )
            await run.wait_until(
                lambda: forming.rendezvous is not None,
                timeout_s=timeout,
                on_timeout=lambda: RefitFailed(
                    Reason.GROUP_FAILED,
                    f"group epoch {new.epoch}: no rendezvous from {run.describe(ids[:1])} "
                    f"within {timeout:g} s",
                ),
            )
            rendezvous = forming.rendezvous or b""
            for rank, member_id in enumerate(ids):
                self._ctx.outbox.send(
                    member_id,
                    msg.JoinGroupCmd(
                        epoch=new.epoch,
                        backend=backend,
                        group_rank=rank,
                        group_size=new.size,
                        num_channels=new.num_channels,
                        rendezvous=rendezvous,
                        timeout_s=timeout,
                    ),
                )
            await run.wait_until(
                lambda: len(forming.joined) == len(ids),
                timeout_s=timeout,
                on_timeout=lambda: RefitFailed(
                    Reason.GROUP_FAILED,
                    f"group epoch {new.epoch}: "
                    f"{run.describe([i for i in ids if i not in forming.joined])}"
                    f" did not join within {timeout:g} s",
                ),
            )
        except RefitFailed:
            await self.poison()
            raise
        finally:
            forming.open = False
        ready = new.model_copy(update={"state": GroupState.READY})
        await self._ctx.store.save_group(ready)
        self.record = ready
        return ready

    async def poison(self) -> None:
        # Store first: a write lost to a store outage leaves memory unchanged, so the
        # caller's retry writes it again (memory first, the retry saw nothing to do and a
        # restarted coordinator reloaded a READY group whose communicators were aborted).
        if self.record.state in (GroupState.READY, GroupState.FORMING):
            poisoned = self.record.model_copy(update={"state": GroupState.POISONED})
            await self._ctx.store.save_group(poisoned)
            self.record = poisoned

    async def departed(self, member: MemberRecord) -> None:
        if member.member_id in self.record.members and self.record.state is GroupState.READY:
            # The next refit needs a new epoch anyway (membership differs); say so now.
            await self.poison()

    async def on_report(
        self, run: RefitRun | None, member: MemberRecord, report: msg.Report
    ) -> bool:
        """Apply a report `is_group_report` accepts; False when it refers to an epoch that is
        not being formed (or not current), or comes from a member it does not name."""
        body = report.body
        mid = member.member_id
        f = self._formation
        forming = f if run is not None and f is not None and f.open else None
        if isinstance(body, msg.RendezvousReady | msg.GroupJoined):
            if run is None or forming is None or body.epoch != forming.epoch:
                return False
            if isinstance(body, msg.RendezvousReady):
                if mid != forming.members[0]:
                    return False
                if not body.rendezvous or len(body.rendezvous) > MAX_RENDEZVOUS_BYTES:
                    run.fail(
                        Reason.GROUP_FAILED,
                        f"{member.describe()} reported a rendezvous of {len(body.rendezvous)} "
                        f"bytes (must be 1..{MAX_RENDEZVOUS_BYTES})",
                    )
                    return True
                forming.rendezvous = body.rendezvous
            elif mid in forming.members:
                forming.joined.add(mid)
            else:
                return False
            run.touch()
            return True
        if not isinstance(body, msg.Failure):
            return False
        if run is not None and forming is not None and body.epoch == forming.epoch:
            if mid not in forming.members:
                return False
            run.fail(
                Reason.GROUP_FAILED,
                f"{member.describe()} failed to set up group epoch {body.epoch}: "
                f"{body.reason}: {body.message}",
            )
            return True
        if body.epoch == self.record.epoch and mid in self.record.members:
            await self.poison()
            return True
        return False
