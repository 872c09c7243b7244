"""Bad or inconsistent values stop the install with a message that says what to change."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart_support import render

pytestmark = pytest.mark.unit

EXTERNAL = {"bundled": {"enabled": False}, "external": {"enabled": True}}

# (values, fragments the error message must contain)
TEMPLATE_FAILURES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "two replicas": ({"replicaCount": 2}, ("replicaCount=2", "single active replica")),
    "zero replicas": ({"replicaCount": 0}, ("replicaCount=0",)),
    "latest image": ({"image": {"tag": "latest"}}, ("image.tag=latest", "pin a version")),
    "bad digest": ({"image": {"digest": "sha256:abc"}}, ("image.digest", "64 hex")),
    "latest redis": (
        {"redis": {"bundled": {"image": {"tag": "latest"}}}},
        ("redis.bundled.image.tag=latest",),
    ),
    "both redis": (
        {"redis": {"external": {"enabled": True, "url": "redis://r:6379/0"}}},
        ("redis.bundled.enabled and redis.external.enabled", "choose one"),
    ),
    "no redis": (
        {"redis": {"bundled": {"enabled": False}}},
        ("no Redis configured", "redis.external.url"),
    ),
    "external without url": (
        {"redis": EXTERNAL},
        ("redis.external.enabled=true needs redis.external.url",),
    ),
    "external with http url": (
        {"redis": {**EXTERNAL, "external": {"enabled": True, "url": "http://redis:6379"}}},
        ("redis.external.url", "redis:// or rediss://"),
    ),
    "external url with password": (
        {"redis": {**EXTERNAL, "external": {"enabled": True, "url": "redis://:hunter2@r:6379/0"}}},
        ("must not contain a password", "redis.external.existingSecret"),
    ),
    "tls without secret": ({"tls": {"enabled": True}}, ("tls.enabled=true needs tls.secretName",)),
    "existing token with auth off": (
        {"auth": {"enabled": False, "existingSecret": "t"}},
        ("auth.existingSecret is set but auth.enabled=false",),
    ),
    "ingress without auth": (
        {
            "auth": {"enabled": False},
            "ingress": {"enabled": True, "hosts": ["h"]},
            "networkPolicy": {"ingressFrom": [{"podSelector": {}}]},
        },
        ("ingress.enabled=true with auth.enabled=false",),
    ),
    "ingress without hosts": (
        {"ingress": {"enabled": True}, "networkPolicy": {"ingressFrom": [{"podSelector": {}}]}},
        ("ingress.hosts",),
    ),
    "ingress blocked by policy": (
        {"ingress": {"enabled": True, "hosts": ["h"]}},
        ("networkPolicy.ingressFrom",),
    ),
    "servicemonitor blocked by policy": (
        {"serviceMonitor": {"enabled": True}},
        ("networkPolicy.metricsFrom",),
    ),
}

SCHEMA_FAILURES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "typo in a key": ({"redis": {"bundeld": {"enabled": True}}}, ("/redis", "bundeld")),
    "unknown top-level key": ({"replicas": 1}, ("replicas",)),
    "unknown pause mode": (
        {"coordinator": {"pauseMode": "pause"}},
        ("/coordinator/pauseMode", "keep"),
    ),
    "port out of range": ({"service": {"grpcPort": 70000}}, ("/service/grpcPort",)),
    "negative timeout": (
        {"coordinator": {"transferTimeoutS": -1}},
        ("/coordinator/transferTimeoutS",),
    ),
    "comma in a job name": (
        {"coordinator": {"allowedJobs": ["a,b"]}},
        ("/coordinator/allowedJobs/0",),
    ),
    "string replica count": ({"replicaCount": "1"}, ("/replicaCount",)),
    "bad appendfsync": (
        {"redis": {"bundled": {"appendfsync": "sometimes"}}},
        ("/redis/bundled/appendfsync",),
    ),
    # An empty selector would admit every pod of the namespace (null deletes a default key).
    "no client labels": (
        {"networkPolicy": {"clientPodLabels": {"refitplane.io/client": None}}},
        ("/networkPolicy/clientPodLabels", "minProperties"),
    ),
    "bad probe port": ({"ports": {"probe": 0}}, ("/ports/probe",)),
}


@pytest.mark.parametrize("case", list(TEMPLATE_FAILURES))
def test_inconsistent_values_fail_with_a_clear_message(case: str) -> None:
    values, fragments = TEMPLATE_FAILURES[case]
    with pytest.raises(helm.HelmRenderError) as caught:
        render(values)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", list(SCHEMA_FAILURES))
def test_schema_rejects_bad_values(case: str) -> None:
    values, fragments = SCHEMA_FAILURES[case]
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"


@pytest.mark.parametrize(
    "values",
    [
        {"replicaCount": 1},
        {"redis": {**EXTERNAL, "external": {"enabled": True, "url": "rediss://user@r:6380/1"}}},
        {"redis": {**EXTERNAL, "external": {"enabled": True, "url": "redis://[fd00::1]:6379"}}},
        {"tls": {"enabled": False, "secretName": "unused"}},
        {"coordinator": {"triggerRatePerS": 0}},
    ],
)
def test_consistent_edge_values_render(values: dict[str, Any]) -> None:
    assert render(values).coordinator()["spec"]["replicas"] == 1
