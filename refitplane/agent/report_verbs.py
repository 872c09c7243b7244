"""`ReportVerbs`: the reports a member sends the coordinator, one method per report kind
(`report_prepared`, `report_transfer_done`, ...), over the session's `_report` (on the
open report stream, else unary, transient errors retried). Each returns whether the
coordinator accepted the report (False: the refit or group epoch is no longer current)."""

from __future__ import annotations

from refitplane.protocol import messages as m


class ReportVerbs:
    def _report(self, refit_id: str, body: m.ReportBody) -> bool:
        raise NotImplementedError  # AgentSession sends it

    def report_rendezvous_ready(self, epoch: int, rendezvous: bytes) -> bool:
        return self._report("", m.RendezvousReady(epoch=epoch, rendezvous=rendezvous))

    def report_group_joined(self, epoch: int) -> bool:
        return self._report("", m.GroupJoined(epoch=epoch))

    def report_prepared(self, refit_id: str) -> bool:
        return self._report(refit_id, m.Prepared())

    def report_progress(
        self, refit_id: str, *, bytes_sent: int = 0, bytes_received: int = 0, bytes_total: int = 0
    ) -> bool:
        return self._report(
            refit_id,
            m.Progress(
                bytes_sent=bytes_sent, bytes_received=bytes_received, bytes_total=bytes_total
            ),
        )

    def report_transfer_done(
        self,
        refit_id: str,
        *,
        bytes_sent: int = 0,
        bytes_received: int = 0,
        seconds: float = 0.0,
        tensors_verified: int = 0,
        tensors_total: int = 0,
        bytes_full: int = 0,
        delta_base_version: int = 0,
        hops: m.HopStamps | None = None,
    ) -> bool:
        return self._report(
            refit_id,
            m.TransferDone(
                bytes_sent=bytes_sent,
                bytes_received=bytes_received,
                seconds=seconds,
                tensors_verified=tensors_verified,
                tensors_total=tensors_total,
                bytes_full=bytes_full,
                delta_base_version=delta_base_version,
                hops=hops or m.HopStamps(),
            ),
        )

    def report_plan_missing(
        self, refit_id: str, plan_digest: str, plan_rank: int, message: str = ""
    ) -> bool:
        """A PrepareRefit named a plan this rank does not hold: the coordinator resends it."""
        return self._report(
            refit_id, m.PlanMissing(plan_digest=plan_digest, plan_rank=plan_rank, message=message)
        )

    def report_replica_updated(self, refit_id: str, version: int) -> bool:
        return self._report(refit_id, m.ReplicaUpdated(version=version))

    def report_failure(
        self,
        refit_id: str,
        reason: str,
        message: str,
        *,
        weights_modified: bool = False,
        epoch: int = 0,
    ) -> bool:
        return self._report(
            refit_id,
            m.Failure(
                reason=reason, message=message, weights_modified=weights_modified, epoch=epoch
            ),
        )
