"""What the rendered chart must guarantee about how the coordinator is reached: its Service,
the optional Ingress (REST only) and ServiceMonitor, and the NetworkPolicies that admit only
its clients (and the coordinator to Redis)."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import (
    NAMESPACE,
    RELEASE,
    Rendered,
    all_variants,
    env_of,
    pod_labels,
    render,
    selector_matches,
)

pytestmark = pytest.mark.unit


# --- Service, Ingress, ServiceMonitor -----------------------------------------------------


def test_service_exposes_grpc_http_metrics(default: Rendered) -> None:
    service = default.one("Service", RELEASE)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {
        "grpc": (50051, "grpc"),
        "lane": (50052, "lane"),
        "http": (8080, "http"),
        "metrics": (9090, "http"),
    }
    assert service["spec"]["type"] == "ClusterIP"


def test_lane_off_leaves_no_lane_port_anywhere() -> None:
    """`ports.lane: 0`: the coordinator runs without a control lane (REFIT_LANE_PORT=off)
    and no Service, container or NetworkPolicy port names one."""
    rendered = render({"ports": {"grpc": 50051, "lane": 0, "http": 8080, "probe": 8081}})
    container = rendered.coordinator_container()
    assert env_of(container)["REFIT_LANE_PORT"]["value"] == "off"
    assert "lane" not in {p["name"] for p in container["ports"]}
    service = rendered.one("Service", RELEASE)
    assert "lane" not in {p["name"] for p in service["spec"]["ports"]}
    for policy in rendered.of_kind("NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            assert "lane" not in {p["port"] for p in rule.get("ports", [])}


def test_optional_objects_are_off_by_default(default: Rendered) -> None:
    assert not default.of_kind("Ingress")
    assert not default.of_kind("ServiceMonitor")


def test_ingress_routes_only_rest() -> None:
    values = all_variants()["ingress"]
    ingress = render(values).one("Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "refit.example.com"
    paths = {p["path"] for p in rule["http"]["paths"]}
    assert paths == {"/v1", "/openapi.json"}
    for path in rule["http"]["paths"]:
        assert path["backend"]["service"] == {"name": RELEASE, "port": {"number": 8080}}
    assert ingress["spec"]["tls"] == values["ingress"]["tls"]


def test_servicemonitor_scrapes_metrics_port() -> None:
    rendered = render(all_variants()["servicemonitor"])
    monitor = rendered.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"
    service = rendered.one("Service", RELEASE)
    assert selector_matches(
        monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


# --- NetworkPolicy ---------------------------------------------------------------------


def test_network_policies_admit_only_clients_and_coordinator(default: Rendered) -> None:
    policy = default.one("NetworkPolicy", RELEASE)
    (rule,) = policy["spec"]["ingress"]
    peers = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert {"refitplane.io/client": "true"} in peers
    assert {p["port"] for p in rule["ports"]} == {"grpc", "lane", "http"}
    test_pod_labels = default.one("Pod")["metadata"]["labels"]
    assert any(selector_matches(peer, test_pod_labels) for peer in peers)

    redis_policy = default.one("NetworkPolicy", f"{RELEASE}-redis")
    assert redis_policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert redis_policy["spec"]["egress"] == []
    (redis_rule,) = redis_policy["spec"]["ingress"]
    (peer,) = redis_rule["from"]
    assert selector_matches(peer["podSelector"]["matchLabels"], pod_labels(default.coordinator()))
    assert not selector_matches(peer["podSelector"]["matchLabels"], test_pod_labels)


def test_network_policy_opens_ingress_and_metrics_peers() -> None:
    values = {
        **all_variants()["ingress"],
        "serviceMonitor": {"enabled": True},
        "networkPolicy": {
            "ingressFrom": [{"namespaceSelector": {"matchLabels": {"name": "ingress"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
            "clientNamespaceLabels": {"refit-clients": "yes"},
        },
    }
    policy = render(values).one("NetworkPolicy", RELEASE)
    clients, ingress, metrics = policy["spec"]["ingress"]
    assert clients["from"][0]["namespaceSelector"] == {"matchLabels": {"refit-clients": "yes"}}
    assert ingress["from"] == values["networkPolicy"]["ingressFrom"]
    assert metrics["from"] == values["networkPolicy"]["metricsFrom"]
    assert ingress["ports"] == metrics["ports"] == [{"port": "http", "protocol": "TCP"}]


def test_network_policy_can_be_disabled() -> None:
    rendered = render({"networkPolicy": {"enabled": False}})
    assert not rendered.of_kind("NetworkPolicy")
    assert "networkPolicy.enabled=false" in rendered.notes
