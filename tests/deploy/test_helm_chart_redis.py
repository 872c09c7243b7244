"""What the rendered chart must guarantee about Redis: the bundled StatefulSet (persistent,
append-only, its password a Secret shared with the coordinator, non-system uid, CPU limit,
pinnable by digest) and an external Redis in its place."""

from __future__ import annotations

import base64
import re

import pytest

from tests.deploy.chart_support import (
    RELEASE,
    Rendered,
    all_variants,
    container,
    env_of,
    pod_spec,
    render,
)

pytestmark = pytest.mark.unit


# --- Redis ---------------------------------------------------------------------------------


def test_bundled_redis_is_persistent_aof(default: Rendered) -> None:
    name = f"{RELEASE}-redis"
    statefulset = default.one("StatefulSet", name)
    conf = default.one("ConfigMap", name)["data"]["redis.conf"].splitlines()
    assert "appendonly yes" in conf
    assert "appendfsync everysec" in conf
    assert "dir /data" in conf
    assert "maxmemory-policy noeviction" in conf
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    redis = container(statefulset, "redis")
    data_mount = next(m for m in redis["volumeMounts"] if m["mountPath"] == "/data")
    assert data_mount["name"] == claim["metadata"]["name"]
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"


def _coordinator_redis_password(rendered: Rendered) -> dict[str, str] | None:
    """The Secret and key the coordinator reads its Redis password from: a mounted file
    (REFIT_REDIS_PASSWORD_FILE), never an environment variable."""
    env = env_of(rendered.coordinator_container())
    assert "REFIT_REDIS_PASSWORD" not in env
    if "REFIT_REDIS_PASSWORD_FILE" not in env:
        return None
    path = env["REFIT_REDIS_PASSWORD_FILE"]["value"]
    mount = next(
        m
        for m in rendered.coordinator_container()["volumeMounts"]
        if path.startswith(m["mountPath"] + "/")
    )
    assert mount["readOnly"] is True
    volume = next(
        v for v in pod_spec(rendered.coordinator())["volumes"] if v["name"] == mount["name"]
    )
    (item,) = volume["secret"]["items"]
    assert item["path"] == path.rsplit("/", 1)[1]
    return {"name": volume["secret"]["secretName"], "key": item["key"]}


def test_bundled_redis_password_from_secret_shared_with_coordinator(default: Rendered) -> None:
    name = f"{RELEASE}-redis"
    statefulset = default.one("StatefulSet", name)
    redis = container(statefulset, "redis")
    # A mounted file for Redis too (checkov CKV_K8S_35): no secret in its environment.
    assert not any("valueFrom" in e for e in redis.get("env", ()))
    volume = next(v for v in pod_spec(statefulset)["volumes"] if v["name"] == "password")
    (item,) = volume["secret"]["items"]
    redis_ref = {"name": volume["secret"]["secretName"], "key": item["key"]}
    mount = next(m for m in redis["volumeMounts"] if m["name"] == "password")
    assert f"{mount['mountPath']}/{item['path']}" in redis["args"][0]
    coordinator_ref = _coordinator_redis_password(default)
    assert redis_ref == coordinator_ref == {"name": name, "key": "redis-password"}
    password = base64.b64decode(default.one("Secret", name)["data"]["redis-password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    # Never in argv or in the ConfigMap.
    assert password not in str(redis["args"]) + str(default.one("ConfigMap", name))


def test_bundled_redis_runs_as_a_non_system_uid_with_a_cpu_limit(default: Rendered) -> None:
    statefulset = default.one("StatefulSet", f"{RELEASE}-redis")
    security = pod_spec(statefulset)["securityContext"]
    assert security["runAsUser"] >= 10000
    assert security["runAsGroup"] >= 10000
    assert container(statefulset, "redis")["resources"]["limits"]["cpu"]


def test_bundled_redis_can_be_pinned_by_digest() -> None:
    digest = "sha256:" + "ab" * 32
    rendered = render({"redis": {"bundled": {"image": {"digest": digest}}}})
    redis = container(rendered.one("StatefulSet", f"{RELEASE}-redis"), "redis")
    assert redis["image"] == f"docker.io/library/redis:7.4.5-alpine@{digest}"


def test_redis_without_persistence_warns() -> None:
    rendered = render({"redis": {"bundled": {"persistence": {"enabled": False}}}})
    statefulset = rendered.one("StatefulSet", f"{RELEASE}-redis")
    assert "volumeClaimTemplates" not in statefulset["spec"]
    data = next(v for v in pod_spec(statefulset)["volumes"] if v["name"] == "data")
    assert "emptyDir" in data
    assert "persistence.enabled=false" in rendered.notes


def test_external_redis_replaces_bundled() -> None:
    rendered = render(all_variants()["external-redis"])
    assert not rendered.of_kind("StatefulSet")
    assert rendered.get("Service", f"{RELEASE}-redis") is None
    assert rendered.get("NetworkPolicy", f"{RELEASE}-redis") is None
    env = env_of(rendered.coordinator_container())
    assert env["REFIT_REDIS_URL"]["value"] == "rediss://redis.example.internal:6380/2"
    assert _coordinator_redis_password(rendered) == {"name": "ext-redis", "key": "password"}


def test_external_redis_without_password() -> None:
    values = {
        "redis": {
            "bundled": {"enabled": False},
            "external": {"enabled": True, "url": "redis://redis:6379/0"},
        }
    }
    assert _coordinator_redis_password(render(values)) is None
