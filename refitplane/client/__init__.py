"""Typed clients for orchestrators (RL frameworks, operators' tools).

    from refitplane.client import RefitClient
    with RefitClient("coordinator:50051", token=...) as client:
        refit = client.trigger("my-job", idempotency_key=f"step-{step}", version=step)
        final = client.wait(refit.refit_id, timeout_s=600)

`AsyncRefitClient` has the same methods as coroutines. Results are the pydantic models of
`refitplane.protocol.models` (re-exported here, with `ClientSettings`); failures raise
`refitplane.errors.RefitError` subclasses. A failed refit's `reason` compares against
`Reason` (`if final.reason == Reason.TIMEOUT: ...`).
"""

from refitplane.client.aio import AsyncRefitClient
from refitplane.client.sync import RefitClient
from refitplane.protocol import Reason
from refitplane.protocol.models import Member, PhaseTiming, RankProgress, Refit, Replica, Topology
from refitplane.protocol.settings import ClientSettings

__all__ = [
    "AsyncRefitClient",
    "ClientSettings",
    "Member",
    "PhaseTiming",
    "RankProgress",
    "Reason",
    "Refit",
    "RefitClient",
    "Replica",
    "Topology",
]
