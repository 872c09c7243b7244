"""What a real coordinator's /metrics carries after refits (one committed, one failed):
every metric the shipped Grafana dashboard queries, request metrics for both transports
with bounded labels, the build-info gauge, and upper-case label values throughout."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from refitplane.agent.simulated import Behaviour
from refitplane.client import RefitClient
from refitplane.errors import NotFound
from refitplane.protocol import RefitState
from refitplane.version import __version__
from tests.integration.conftest import wait_until
from tests.support import dashboard

pytestmark = pytest.mark.integration


@pytest.fixture
def scraped(coordinator, sim_cluster) -> dict[str, list[tuple[dict[str, str], float]]]:
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a", sidecar=True)
    client: RefitClient = cluster.client()
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).state is RefitState.COMMITTED
    for m in cluster.members:
        m.agent.behaviour = Behaviour(fail={"start_transfer": ("PEER_FAILED", "boom", False)})
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).state is RefitState.FAILED
    with pytest.raises(NotFound):
        client.get("no-such-refit")
    with httpx.Client(base_url=coordinator.http_url, timeout=10) as http:
        assert http.get("/v1/jobs/job/topology").status_code == 200
        assert http.get("/v1/jobs/nosuchjob/refits").status_code == 404
        assert http.get("/no/such/route").status_code == 404
        text = http.get("/metrics").text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_every_metric_the_dashboard_queries_is_exposed(scraped):
    missing = {
        (title, name)
        for title, expr in dashboard.queries(dashboard.load())
        for name in dashboard.metric_names(expr)
        if name not in scraped
    }
    assert not missing, f"the dashboard queries metrics the coordinator does not expose: {missing}"


def test_request_metrics_for_both_transports(scraped):
    grpc_calls = {
        (labels["service"], labels["method"], labels["code"]): value
        for labels, value in scraped["refit_grpc_requests_total"]
    }
    assert grpc_calls[("refit.v1.RefitService", "GetRefit", "NOT_FOUND")] == 1
    assert grpc_calls[("refit.v1.RefitService", "TriggerRefit", "OK")] == 2
    assert grpc_calls[("refit.v1.AgentService", "Register", "OK")] >= 3
    unary = {labels["method"] for labels, _ in scraped["refit_grpc_request_duration_seconds_count"]}
    assert "TriggerRefit" in unary
    assert "StreamCommands" not in unary  # a stream's lifetime is not a latency
    http_requests = {
        (labels["method"], labels["route"], labels["status"]): value
        for labels, value in scraped["refit_http_requests_total"]
    }
    assert http_requests[("GET", "/v1/jobs/{job}/topology", "200")] == 1
    assert http_requests[("GET", "/v1/jobs/{job}/refits", "404")] == 1
    assert http_requests[("GET", "unmatched", "404")] == 1
    assert all("nosuchjob" not in route for _, route, _ in http_requests)


def test_build_info_failures_and_replica_versions(scraped):
    ((build, value),) = scraped["refit_build_info"]
    assert value == 1
    assert build["version"] == __version__
    assert build["store"] == "embedded"
    failures = {(lab["refit_job"], lab["reason"]): v for lab, v in scraped["refit_failures_total"]}
    assert failures == {("job", "PEER_FAILED"): 1}
    refits = {(lab["refit_job"], lab["outcome"]): v for lab, v in scraped["refit_refits_total"]}
    assert refits == {("job", "COMMITTED"): 1, ("job", "FAILED"): 1}
    versions = {
        (lab["refit_job"], lab["replica"]): v for lab, v in scraped["refit_replica_version"]
    }
    assert versions == {("job", "a"): 1}
    ((_, throughput),) = scraped["refit_throughput_bytes_per_second_count"]
    assert throughput == 1


def test_label_values_are_upper_case(scraped):
    enum_labels = {"outcome", "phase", "state", "reason", "path", "how", "code"}
    for name, series in scraped.items():
        if not name.startswith("refit_"):
            continue
        for labels, _ in series:
            for key, value in labels.items():
                if key in enum_labels:
                    assert value == value.upper(), f"{name}{{{key}={value!r}}}"


def test_a_watch_the_client_stops_counts_as_cancelled(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a")
    for m in cluster.members:
        m.agent.behaviour = Behaviour(hold_transfer_s=30)
    client: RefitClient = cluster.client()
    refit = client.trigger("job")
    watch = client.watch(refit.refit_id)
    next(watch)
    watch.close()  # the client cancels the stream mid-refit
    registry = coordinator.core.metrics.registry

    def watches(code: str) -> float:
        labels = {"service": "refit.v1.RefitService", "method": "WatchRefit", "code": code}
        return registry.get_sample_value("refit_grpc_requests_total", labels) or 0.0

    # Counted before the refit ends: cancelling the refit first raced the client's cancel
    # (the watch could end on the CANCELLED record, OK, before the server saw the stream go;
    # a clean-clone CI run on a loaded box did).
    wait_until(lambda: watches("CANCELLED") == 1, what="the cancelled watch to be counted")
    client.cancel(refit.refit_id)
    assert watches("UNKNOWN") == 0
    assert watches("OK") == 0
