"""PrepareRefit for data-plane members: each gets its rank plan named by digest and rank, with
the body only when it has not acknowledged holding it; a member that reports the plan missing
(it evicted or lost it) is sent the body again, a bounded number of times per refit."""

from __future__ import annotations

import logging

from refitplane.coordinator.core.metrics import Metrics
from refitplane.coordinator.core.outbox import Outbox
from refitplane.coordinator.core.planning import PlanHoldings
from refitplane.coordinator.core.records import MemberRecord
from refitplane.coordinator.core.run import RefitRun
from refitplane.coordinator.settings import Settings
from refitplane.protocol import Reason
from refitplane.protocol import messages as msg
from refitplane.reshard.plan import RankPlan

log = logging.getLogger(__name__)

# A member that reports PlanMissing again after the body was sent this often fails the refit
# (once is the normal case: it evicted or lost the plan).
MAX_PLAN_RESENDS = 2


class PlanDelivery:
    """One job's rank plans on their way out: which members hold which plans (across refits),
    and for the refit being prepared, each member's plan, the group epoch it runs in and how
    many times its body was sent again."""

    def __init__(self, settings: Settings, outbox: Outbox, metrics: Metrics) -> None:
        self._s = settings
        self._outbox = outbox
        self._metrics = metrics
        self.holdings = PlanHoldings()
        self._refit_id = ""
        self._epoch = 0
        self._plans: dict[str, RankPlan] = {}
        self._resends: dict[str, int] = {}

    def begin(self, run: RefitRun, epoch: int) -> None:
        """The refit `run` is prepared in group epoch `epoch`: forget the last one's plans."""
        self._refit_id = run.refit_id
        self._epoch = epoch
        self._plans = {}
        self._resends = {}

    def plan_of(self, run: RefitRun, member_id: str) -> RankPlan | None:
        """The rank plan `member_id` was sent for `run` (None: a sidecar, another refit)."""
        return self._plans.get(member_id) if run.refit_id == self._refit_id else None

    def send(self, run: RefitRun, member_id: str, plan: RankPlan) -> None:
        self._plans[member_id] = plan
        self._send(run, member_id, resend=False)

    def _send(self, run: RefitRun, member_id: str, *, resend: bool) -> None:
        """PrepareRefit for a data-plane member: its plan named by digest and rank, with the
        body only if the member has not acknowledged holding it (under this member id, in
        this epoch) or reported it missing (`resend`)."""
        plan = self._plans[member_id]
        key = (plan.plan_digest, plan.rank)
        named_only = not resend and self.holdings.holds(member_id, self._epoch, key)
        self._outbox.send(
            member_id,
            msg.PrepareRefitCmd(
                refit_id=run.refit_id,
                version=run.record.version,
                epoch=self._epoch,
                plan=None if named_only else plan,
                config=self._s.transfer,
                plan_digest=plan.plan_digest,
                plan_rank=plan.rank,
                delta_peers=run.delta.peers.get(member_id, frozenset()),
                delta_base_version=run.delta.base_version,
            ),
        )
        how = "RESENT" if resend else "REFERENCE" if named_only else "BODY"
        self._metrics.rank_plans.labels(how).inc()

    def prepared(self, run: RefitRun, member_id: str) -> None:
        """`member_id` reported Prepared: it holds the plan it was sent."""
        plan = self.plan_of(run, member_id)
        if plan is not None:
            self.holdings.acknowledge(member_id, self._epoch, (plan.plan_digest, plan.rank))

    def forget(self, member_id: str) -> None:
        self.holdings.forget(member_id)

    def plan_missing(self, run: RefitRun, member: MemberRecord, body: msg.PlanMissing) -> bool:
        """A member does not hold the plan its PrepareRefit named: send it the body (the
        refit goes on; PREPARING's deadline still bounds it). False: the report is stale."""
        mid = member.member_id
        plan = self.plan_of(run, mid)
        if (
            plan is None
            or (plan.plan_digest, plan.rank) != (body.plan_digest, body.plan_rank)
            or mid in run.prepared
            or run.transfer_started
        ):
            return False
        self.holdings.forget(mid, (plan.plan_digest, plan.rank))
        resends = self._resends.get(mid, 0)
        if resends >= MAX_PLAN_RESENDS:
            run.fail(
                Reason.PLAN_MISSING,
                f"{member.describe()} reported plan {plan.plan_digest[:12]} (rank {plan.rank}) "
                f"missing again after it was sent {resends} time(s): {body.message}",
            )
            return True
        self._resends[mid] = resends + 1
        log.info(
            "refit %s: %s does not hold plan %s rank %d (%s): sending it",
            run.refit_id,
            member.describe(),
            plan.plan_digest[:12],
            plan.rank,
            body.message,
        )
        self._send(run, mid, resend=True)
        return True
