"""`RanksVerifiedWait`: how a replica controller learns that every rank of its replica
verified the transfer before it lets vLLM finish, and that the refit did not fail meanwhile:
the replica's ranks read from the topology at PrepareRefit, the coordinator's RanksVerified
push (or, where it cannot come, reads of the refit's record), and the checks after vLLM's
finish (docs/generator.md, "Waiting for the ranks")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from refitplane.agent.session import AgentSession
from refitplane.client.sync import RefitClient
from refitplane.errors import TransferError
from refitplane.protocol import RefitState, Role
from refitplane.protocol.models import Refit
from refitplane.replica.control import touches_live_weights
from refitplane.replica.told import StreamNews

# How often a wait for RanksVerified looks whether the command stream it would come on broke.
_STREAM_LOOK_S = 0.1
_ENDED = {RefitState.FAILED, RefitState.CANCELLED}


class FailRefit(Protocol):
    """The controller's failure of the refit at its replica: the error to raise, with the
    replica left not ready where `touched` (weights of the refit may be in the engine)."""

    def __call__(self, message: str, *, touched: bool) -> TransferError: ...


class RanksVerifiedWait:
    """The replica's ranks and the wait for all of them to verify, for one controller."""

    def __init__(
        self,
        client: RefitClient,
        news: StreamNews,
        *,
        job: str,
        replica_id: str,
        verify_wait_s: float,
        session: Callable[[], AgentSession | None],
        fail: FailRefit,
    ) -> None:
        self.client = client
        self.news = news
        self.job = job
        self.replica_id = replica_id
        self.verify_wait_s = verify_wait_s
        self._session = session
        self._fail = fail
        # Read from the topology (`read_ranks`), for group epoch `epoch`.
        self.rank_ids: set[str] = set()
        self.touches_live = False
        self.epoch: tuple[int, int] = (-1, 0)
        # The session's (registrations, command streams opened) when this refit's PrepareRefit
        # was handled: a RanksVerified is lost only with the stream or registration it went to.
        self._stream_mark: tuple[int, int] = (0, 0)

    def ranks_stale(self, epoch: int) -> bool:
        """Whether the ranks must be read again for group epoch `epoch`: ranks only change
        with the group, but a coordinator that restarted on an empty store numbers epochs
        from 1 again, with every rank under a new member id (hence this registration too)."""
        return self.epoch != self._epoch_key(epoch) or not self.rank_ids

    def read_ranks(self, epoch: int) -> None:
        """The replica's rank member ids, and whether they receive into live parameters."""
        ranks = self._replica_ranks()
        self.rank_ids = {m.member_id for m in ranks}
        self.touches_live = touches_live_weights([m.labels.get("receive_mode", "") for m in ranks])
        self.epoch = self._epoch_key(epoch)

    def mark_streams(self) -> None:
        """Note the session's registrations and streams opened: before Prepared, since the
        coordinator sends RanksVerified only after it."""
        self._stream_mark = self._session_mark()

    def _replica_ranks(self) -> list[Any]:
        topo = self.client.topology(self.job)
        return [
            m for m in topo.members if m.role == Role.GENERATOR and m.replica_id == self.replica_id
        ]

    def _epoch_key(self, epoch: int) -> tuple[int, int]:
        """What the ranks read are valid for: the group epoch, under this registration."""
        session = self._session()
        return epoch, session.registrations if session is not None else 0

    def _session_mark(self) -> tuple[int, int]:
        s = self._session()
        return (s.registrations, s.streams_opened) if s is not None else (0, 0)

    def require_verified(self, refit_id: str, *, pushed: bool, touched: bool) -> None:
        """Wait until the coordinator says every rank of the replica verified (RanksVerified,
        pushed when it accepts the last rank's verified TransferDone), or the refit failed
        (AbortRefit, which follows any RanksVerified of the refit on the same stream), for up
        to `verify_wait_s`. The push is lost only with the stream it was written to, or with
        this member's registration (a coordinator that lost its store, a lapsed lease): once
        either moved since PrepareRefit, and at the deadline, the record is read instead
        (`_read_verified`), so a restarted coordinator or a lost store shows as the refit's
        end or as an error, never as success. Not `pushed` (a coordinator that does not send
        RanksVerified): the record is read until the ranks verified, backing off from 2 ms.
        `touched`: whether the failure leaves the replica not ready."""
        deadline = time.monotonic() + self.verify_wait_s
        delay = 0.002
        while True:
            self.news.clear()
            verified, abort = self.news.of(refit_id)
            if abort is not None:
                raise self._fail(f"refit aborted: {abort.reason} {abort.message}", touched=touched)
            if verified is not None:
                if self.rank_ids and self.rank_ids <= verified.member_ids:
                    return
                # The coordinator's ranks of this replica are not the ones read at
                # PrepareRefit: the record says which of ours verified.
                self._read_verified(refit_id, last=True, touched=touched)
                return
            mark = self._session_mark()
            if mark != self._stream_mark or not pushed:
                self._stream_mark = mark
                if self._read_verified(refit_id, last=False, touched=touched):
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._read_verified(refit_id, last=True, touched=touched)
                return
            self.news.wait(min(remaining, _STREAM_LOOK_S if pushed else delay))
            delay = min(2 * delay, 0.05)

    def _read_verified(self, refit_id: str, *, last: bool, touched: bool) -> bool:
        """One GetRefit: whether every rank of the replica verified. Raises when the refit
        ended, and (`last`) when a rank did not verify, naming it."""
        ranks = self.rank_ids
        refit = self.read_unended(refit_id, when="", touched=touched)
        done = {r.member_id for r in refit.ranks if r.member_id in ranks and r.fully_verified}
        if ranks and done == ranks:
            return True
        if last:
            missing = sorted(ranks - done)
            raise self._fail(
                f"ranks {missing} of replica {self.replica_id} did not verify the transfer",
                touched=touched,
            )
        return False

    def require_not_told_aborted(self, refit_id: str) -> None:
        """After vLLM's finish: an AbortRefit of the refit already on the stream fails it
        without asking anyone."""
        _, abort = self.news.of(refit_id)
        if abort is not None:
            raise self._fail(
                f"refit aborted while finishing: {abort.reason} {abort.message}", touched=True
            )

    def require_not_failed(self, refit_id: str) -> None:
        """After vLLM's finish, before the KV cache wakes: the refit did not fail meanwhile.
        An AbortRefit already here says so without asking; otherwise the record is read,
        because the AbortRefit that the coordinator queues before it shows the failure may
        still be on its way (docs/generator.md, "Waiting for the ranks")."""
        self.require_not_told_aborted(refit_id)
        self.read_unended(refit_id, when=" while finishing", touched=True)

    def read_unended(self, refit_id: str, *, when: str, touched: bool) -> Refit:
        """One GetRefit: the refit, unless it ended (FAILED or CANCELLED): then this
        replica's failure, naming the state, `when` it was read, the reason and the
        coordinator's message."""
        refit: Refit = self.client.get(refit_id)
        if refit.state in _ENDED:
            raise self._fail(
                f"refit {refit.state.value}{when}: {refit.reason} {refit.message}",
                touched=touched,
            )
        return refit
