"""The replica controller's staging gauge, against a real coordinator (simulated data plane):
after each committed refit it reads the workers' staging peaks through vLLM, except where
every worker said it stages nothing (their peaks stay 0 while the ranks stay the same), so
such a replica's refits make no round trip through vLLM between the last byte and the
report; a replica with a staging worker is asked after every refit."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from refitplane.client import RefitClient
from refitplane.generator.sidecar import StagingMetrics
from refitplane.protocol import Role
from refitplane.replica.control import CallerPausedControl
from tests.integration.conftest import row_layout
from tests.support.controllers import start_controller

pytestmark = pytest.mark.integration

GAUGE = "refit_generator_staging_peak_bytes"


class StatusEngine(CallerPausedControl):
    """The weight-update verbs succeed; `engine_status` answers `statuses` and counts calls."""

    def __init__(self, statuses: list[dict[str, Any]]) -> None:
        self.statuses = statuses
        self.status_calls = 0

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return 200

    def start_update(self) -> int:
        return 200

    def update(self, update_info: dict[str, Any]) -> int:
        return 200

    def finish(self, version: int | None) -> int:
        return 200

    def engine_status(self, timeout_s: float = 30.0) -> list[dict[str, Any]] | None:
        self.status_calls += 1
        return self.statuses


@pytest.mark.parametrize(
    ("status", "asked"),
    [
        ({"rank": 0, "staging_peak_bytes": 0, "stages": False}, 1),  # live, nothing staged
        ({"rank": 0, "staging_peak_bytes": 4096, "stages": True}, 3),  # layerwise / fallback
        ({"rank": 0, "staging_peak_bytes": 0}, 3),  # an older worker: no `stages` field
    ],
)
def test_the_gauge_is_read_again_only_where_a_worker_stages(
    coordinator, sim_cluster, status: dict[str, Any], asked: int
) -> None:
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
    engine = StatusEngine([status])
    registry = CollectorRegistry()
    client = RefitClient(coordinator.grpc_target)
    _, session = start_controller(
        coordinator.grpc_target, engine, client, metrics=StagingMetrics(registry, "a")
    )
    try:
        for _ in range(3):
            refit = client.wait(client.trigger("job").refit_id, timeout_s=30)
            assert refit.state.value == "COMMITTED", refit.message
        assert engine.status_calls == asked
        expected = status["staging_peak_bytes"]
        assert registry.get_sample_value(GAUGE, {"replica": "a", "rank": "0"}) == expected
    finally:
        session.close()
        client.close()
