"""Commands → protobuf for the command streams, converting each rank's plan once.

A steady job sends every rank the same plan each step; converting it (thousands of boxes on
large models) on every PrepareRefit would dominate trigger-to-command latency, so the
converted RankPlan is kept per (plan digest, rank) and copied into each command.
"""

from __future__ import annotations

import collections
import dataclasses

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.protocol import convert
from refitplane.protocol.messages import Command, PrepareRefitCmd


class CommandEncoder:
    def __init__(self, *, capacity: int = 4096) -> None:
        self._plans: collections.OrderedDict[tuple[str, int], cpb.RankPlan] = (
            collections.OrderedDict()
        )
        self._capacity = capacity

    def encode(self, command: Command) -> apb.Command:
        body = command.body
        if not isinstance(body, PrepareRefitCmd) or body.plan is None:
            return convert.command_to_proto(command)
        key = (body.plan.plan_digest, body.plan.rank)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = convert.rank_plan_to_proto(body.plan)
            while len(self._plans) > self._capacity:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        out = convert.command_to_proto(
            Command(seq=command.seq, body=dataclasses.replace(body, plan=None))
        )
        out.prepare_refit.plan.CopyFrom(plan)
        return out
