"""Typed clients for orchestrators (RL frameworks, operators' tools).

    from refitplane.client import RefitClient
    with RefitClient("coordinator:50051", token=...) as client:
        refit = client.trigger("my-job", idempotency_key=f"step-{step}", version=step)
        final = client.wait(refit.refit_id, timeout_s=600)

`AsyncRefitClient` has the same methods as coroutines. Results are the pydantic models of
`refitplane.client.models`; failures raise `refitplane.errors.RefitError` subclasses.
"""

from refitplane.client.aio import AsyncRefitClient
from refitplane.client.models import Member, PhaseTiming, RankProgress, Refit, Replica, Topology
from refitplane.client.settings import ClientSettings
from refitplane.client.sync import RefitClient

__all__ = [
    "AsyncRefitClient",
    "ClientSettings",
    "Member",
    "PhaseTiming",
    "RankProgress",
    "Refit",
    "RefitClient",
    "Replica",
    "Topology",
]
