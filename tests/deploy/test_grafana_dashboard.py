"""The Grafana dashboard shipped with the chart: well-formed (unique ids, every query on the
templated Prometheus data source, panels on the grid), rendered by the chart into the
ConfigMap Grafana's sidecar loads, unchanged. That every metric it queries exists on a
real coordinator is tests/integration/coordinator/test_metrics_exposed.py."""

from __future__ import annotations

import json

import pytest

from tests.deploy.chart_support import RELEASE, render
from tests.support import dashboard

pytestmark = pytest.mark.unit


def test_dashboard_is_well_formed() -> None:
    doc = dashboard.load()
    assert doc["uid"] == "refit-coordinator"
    assert isinstance(doc["schemaVersion"], int)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "job"} <= names
    titles = set()
    for panel in doc["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        titles.add(panel["title"])
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            assert expr.count("{") == expr.count("}"), expr
            assert dashboard.metric_names(expr), f"{panel['title']}: no refit metric in {expr}"
    # What the issue asks a platform team can see at a glance.
    for wanted in (
        "Refit rate by outcome",
        "Phase latency p99",
        "Bytes moved",
        "Failures by reason",
        "Replica versions",
    ):
        assert wanted in titles


def test_histogram_queries_use_buckets_and_counters_rates() -> None:
    for title, expr in dashboard.queries(dashboard.load()):
        if "histogram_quantile" in expr:
            assert "_bucket" in expr, title
            assert "by (le" in expr, title
        for name in dashboard.metric_names(expr):
            if name.endswith("_total"):
                assert "rate(" in expr or "increase(" in expr, f"{title}: raw counter {name}"


def test_the_chart_ships_it_as_a_sidecar_configmap() -> None:
    by_default = render().of_kind("ConfigMap")
    assert all("dashboard" not in m["metadata"]["name"] for m in by_default)
    rendered = render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    cm = rendered.one("ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["refit-coordinator.json"]) == dashboard.load()


def test_metric_names_are_read_from_queries() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(refit_duration_seconds_bucket{outcome="X"}'
        '[5m]))) + refit_replica_version{refit_job=~"$job"}'
    )
    assert dashboard.metric_names(expr) == {
        "refit_duration_seconds_bucket",
        "refit_replica_version",
    }
