"""How a refit ends badly: FAILED or CANCELLED with its reason, its participants told to
abort, the group epoch poisoned (its communicators may be mid-operation), and the replicas
whose weights may have changed marked DEGRADED — for the refit a driver is running and for
one a previous coordinator left in flight."""

from __future__ import annotations

import asyncio
import logging
import time

from refitplane.coordinator.core.context import DriverContext
from refitplane.coordinator.core.failures import RefitFailed
from refitplane.coordinator.core.groups import GroupEpochs
from refitplane.coordinator.core.records import RefitRecord
from refitplane.coordinator.core.replicas import ReplicaHealth
from refitplane.coordinator.core.run import RefitRun, phase_seconds
from refitplane.errors import Conflict, Unavailable
from refitplane.protocol import Reason, RefitState
from refitplane.protocol import messages as msg

log = logging.getLogger(__name__)

# Persisting a refit's end through a store outage: back off up to this, log once after this
# many attempts (~10 s).
_PERSIST_BACKOFF_MAX_S = 2.0
_LOG_PERSIST_AFTER = 8


class RefitEndings:
    def __init__(self, ctx: DriverContext, groups: GroupEpochs, replicas: ReplicaHealth) -> None:
        self._ctx = ctx
        self._groups = groups
        self._replicas = replicas

    async def failed(self, run: RefitRun, failure: RefitFailed) -> None:
        """End the refit being driven as FAILED (CANCELLED when cancel caused it): persisted
        (retried through a store outage), participants told to abort, the group epoch
        poisoned, replicas whose weights may have changed marked DEGRADED.

        A terminal state is immutable, so nobody reads it before it is durable: until the
        write succeeds, readers and watchers keep seeing the state in flight. (Shown earlier,
        a coordinator that died before the write would leave the refit in flight for the
        next one to fail with another reason.) The write is retried until it lands or the
        driver stops; the job's driver has nothing else to do without its store."""
        # From here on reports are refused (`JobDriver.on_report`), also for a failure that was
        # raised rather than signalled (a timeout): a replica controller takes a version only
        # on an accepted ReplicaUpdated, and one accepted while this runs would be DEGRADED.
        run.fail(failure.reason, failure.message)
        cancelled = run.cancelled and failure.reason == Reason.CANCELLED
        state = RefitState.CANCELLED if cancelled else RefitState.FAILED
        if run.commands_sent:
            abort = msg.AbortRefitCmd(
                refit_id=run.refit_id, reason=failure.reason, message=failure.message
            )
            for member_id in run.cast.participants:
                self._ctx.outbox.send(member_id, abort)
        # A replica whose weights may have changed: one that said so, or one that was told to
        # transfer into live parameters and did not finish (ranks receiving into staging —
        # label receive_mode=staged — keep their weights until the reload, which reports).
        degraded = [
            r
            for r in run.cast.replica_ranks
            if r not in run.record.replicas_done
            and (
                r in run.weights_modified
                or (run.transfer_started and not run.cast.receives_staged(r))
            )
        ]
        now = time.time()
        record = run.record.model_copy(
            update={
                "state": state,
                "reason": failure.reason,
                "message": failure.message,
                "timings": phase_seconds(run.record, now),
                "phase_started_unix": now,
                "updated_unix": now,
                "replicas_degraded": degraded,
            }
        )
        log.warning(
            "refit %s %s: %s: %s",
            run.refit_id,
            state.value.lower(),
            failure.reason,
            failure.message,
        )
        attempt = 0
        while True:
            try:
                if run.commands_sent:
                    await self._groups.poison()
                await self._replicas.set_degraded(degraded, degraded=True)
                await self._ctx.store.transition(record, [run.record.state])
                break
            except Unavailable:
                if attempt == _LOG_PERSIST_AFTER:
                    log.error(
                        "refit %s: its %s state is not persisted yet (store unavailable); retrying",
                        run.refit_id,
                        state.value,
                    )
                attempt += 1
                await asyncio.sleep(min(_PERSIST_BACKOFF_MAX_S, 0.1 * 2**attempt))
        run.record = record
        self._ctx.events.publish(record)
        self._ctx.metrics.finished(
            state, record.timings, now - record.created_unix, job=record.job, reason=record.reason
        )

    async def orphaned(self, record: RefitRecord) -> None:
        """A refit in flight that no task drives: its coordinator stopped. Fail it; its
        participants get AbortRefit when their command streams reconnect."""
        message = f"the coordinator restarted while the refit was {record.state.value}"
        for member_id in record.participants:
            self._ctx.outbox.send(
                member_id,
                msg.AbortRefitCmd(
                    refit_id=record.refit_id,
                    reason=Reason.COORDINATOR_RESTARTED,
                    message=message,
                ),
            )
        degraded = []
        if record.state in (RefitState.TRANSFERRING, RefitState.VERIFYING):
            degraded = [r for r in record.target_replicas if r not in record.replicas_done]
        await self._groups.poison()
        # Unverified: their ranks may have finished (the data plane does not need the
        # coordinator) or not; what they report holding decides (ReplicaHealth.adopt).
        await self._replicas.set_degraded(degraded, degraded=True, unverified=True)
        now = time.time()
        failed = record.model_copy(
            update={
                "state": RefitState.FAILED,
                "reason": Reason.COORDINATOR_RESTARTED,
                "message": message,
                "timings": phase_seconds(record, now),
                "phase_started_unix": now,
                "updated_unix": now,
                "replicas_degraded": degraded,
            }
        )
        try:
            await self._ctx.store.transition(failed, [record.state])
        except Conflict:
            return
        log.warning("refit %s failed: %s", record.refit_id, message)
        self._ctx.events.publish(failed)
        self._ctx.metrics.finished(
            RefitState.FAILED,
            failed.timings,
            now - record.created_unix,
            job=record.job,
            reason=failed.reason,
        )
