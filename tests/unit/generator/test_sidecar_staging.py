"""The sidecar's reading of receive modes and its staging gauge."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from refitplane.generator.sidecar import StagingMetrics
from refitplane.replica.control import touches_live_weights

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("modes", "touches"),
    [
        (["staged", "staged"], False),  # applied only at finish, after the replica verified
        (["live"], True),
        (["layerwise", "layerwise"], True),  # buckets applied during the transfer
        (["staged", "layerwise"], True),
        (["staged", ""], True),  # a rank without the label: assume the worst
        ([], True),
    ],
)
def test_which_receive_modes_touch_weights_during_a_transfer(
    modes: list[str], touches: bool
) -> None:
    assert touches_live_weights(modes) is touches


def test_the_gauge_holds_each_workers_last_peak() -> None:
    registry = CollectorRegistry()
    metrics = StagingMetrics(registry, "gen-0")
    statuses: list[dict[str, Any]] = [
        {"rank": 0, "staging_peak_bytes": 787968},
        {"rank": 1, "staging_peak_bytes": 786432},
        {"rank": 2},  # an engine without the field (older worker): left out
    ]
    metrics.update(statuses)
    metrics.update([{"rank": 1, "staging_peak_bytes": 1024}])
    name = "refit_generator_staging_peak_bytes"
    assert registry.get_sample_value(name, {"replica": "gen-0", "rank": "0"}) == 787968
    assert registry.get_sample_value(name, {"replica": "gen-0", "rank": "1"}) == 1024
    assert registry.get_sample_value(name, {"replica": "gen-0", "rank": "2"}) is None
    assert b'refit_generator_staging_peak_bytes{rank="0",replica="gen-0"}' in generate_latest(
        registry
    )
