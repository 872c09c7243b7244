"""What the report-path tests share: the coordinator's count of reports by how they came
(`refit_agent_reports_total{via}`), a refit that must commit, and a small job that has run
three of them (one trainer, a TP2 replica with its sidecar)."""

from __future__ import annotations

from typing import Any

from refitplane.client import RefitClient
from refitplane.protocol import RefitState


def reports(coord: Any, via: str = "UNARY") -> float:
    """Reports the coordinator handled, by how they came: LANE, STREAM or UNARY."""
    value = coord.core.metrics.registry.get_sample_value("refit_agent_reports_total", {"via": via})
    return value or 0.0


def commit(client: RefitClient, job: str = "job") -> Any:
    refit = client.wait(client.trigger(job).refit_id, timeout_s=20)
    assert refit.state is RefitState.COMMITTED, f"{refit.reason}: {refit.message}"
    return refit


def three_refits(coordinator: Any, sim_cluster: Any) -> Any:
    """A trainer and a TP2 replica with its sidecar, three refits committed: the cluster."""
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a", world=2, sidecar=True)
    client = cluster.client()
    for _ in range(3):
        commit(client)
    return cluster
