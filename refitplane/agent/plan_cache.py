"""The rank plans a data-plane rank was sent, kept so that later refits only name them.

The coordinator sends a rank its plan once (per member id and group epoch) and from then
on names it by (plan digest, group rank), so a refit costs the same whatever the number of
tensors. A rank keeps the few plans it used last (a job alternates between few layouts:
all replicas, one replica, a replica that joined); what a plan implies for the rank (bytes
each way, tensors received) is worked out once, when it arrives. A named plan that is no
longer here is not an error: the rank answers PlanMissing and the coordinator resends it.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from refitplane.errors import InvalidArgument
from refitplane.protocol.messages import PrepareRefitCmd
from refitplane.reshard.plan import RankPlan

# Plans kept per rank; each is the rank's part only (at most a few MB on the largest models).
DEFAULT_CAPACITY = 4

PlanKey = tuple[str, int]


@dataclass(frozen=True)
class HeldPlan:
    """A rank plan and what it implies for the rank, computed once per plan."""

    plan: RankPlan
    send_bytes: int
    recv_bytes: int
    # Distinct tensors this rank receives pieces of (what receivers verify).
    tensors_received: int

    @staticmethod
    def of(plan: RankPlan) -> HeldPlan:
        return HeldPlan(
            plan=plan,
            send_bytes=plan.send_bytes,
            recv_bytes=plan.recv_bytes,
            tensors_received=plan.tensors_received,
        )


class RankPlanCache:
    """Rank plans by (plan digest, rank), least recently used evicted first. Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise InvalidArgument(f"plan cache capacity {capacity} must be at least 1")
        self.capacity = capacity
        self._plans: collections.OrderedDict[PlanKey, HeldPlan] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Commands that carried a body / were served from the cache / named a plan not here.
        self.bodies = 0
        self.hits = 0
        self.misses = 0

    def resolve(self, cmd: PrepareRefitCmd) -> HeldPlan | None:
        """The plan `cmd` runs: its body (kept for later refits) or the cached plan it names;
        None when it names a plan this rank does not hold."""
        if cmd.plan is not None:
            plan = cmd.plan
            if cmd.plan_digest and cmd.plan_key != (plan.plan_digest, plan.rank):
                raise InvalidArgument(
                    f"PrepareRefit names plan {cmd.plan_digest[:12]} rank {cmd.plan_rank} but "
                    f"carries plan {plan.plan_digest[:12]} rank {plan.rank}",
                    field="plan_digest",
                )
            return self.put(plan)
        with self._lock:
            held = self._plans.get(cmd.plan_key)
            if held is None:
                self.misses += 1
                return None
            self._plans.move_to_end(cmd.plan_key)
            self.hits += 1
            return held

    def put(self, plan: RankPlan) -> HeldPlan:
        key = (plan.plan_digest, plan.rank)
        with self._lock:
            self.bodies += 1
            held = self._plans.get(key)
            # The same plan again (a coordinator that restarted): keep the object the
            # executor already resolved its views for.
            if held is None:
                held = HeldPlan.of(plan)
                self._plans[key] = held
            self._plans.move_to_end(key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
            return held

    def missing_message(self, cmd: PrepareRefitCmd) -> str:
        with self._lock:
            kept = len(self._plans)
        return (
            f"plan {cmd.plan_digest[:12]} rank {cmd.plan_rank} is not in this rank's plan cache "
            f"({kept} of at most {self.capacity} plans kept)"
        )

    def keys(self) -> list[PlanKey]:
        with self._lock:
            return list(self._plans)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)
