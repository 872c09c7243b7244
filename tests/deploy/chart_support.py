"""Offline rendering of the refit-coordinator chart for tests.

Helm's own Go SDK renders the chart (helm-python-sdk binds it through ctypes: no helm
binary, no cluster, no network). `lookup` sees no cluster, exactly like `helm template`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "refit-coordinator"
EXAMPLES_DIR = REPO / "deploy" / "examples"
RELEASE = "refit-coordinator"
NAMESPACE = "refit"


def _min_kube_version() -> str:
    constraint = str(yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["kubeVersion"])
    match = re.search(r">=\s*v?(\d+\.\d+\.\d+)", constraint)
    if match is None:
        raise ValueError(f"Chart.yaml kubeVersion {constraint!r} has no lower bound")
    return match.group(1)


# Rendered manifests are validated on the chart's minimum Kubernetes (Chart.yaml kubeVersion)
# and on the newest version kubernetes-validate knows.
MIN_KUBE_VERSION = _min_kube_version()

# Everything the coordinator reads (the settings contract shared with the control plane).
COORDINATOR_ENV = frozenset(
    {
        "REFIT_GRPC_HOST",
        "REFIT_GRPC_PORT",
        "REFIT_LANE_PORT",
        "REFIT_HTTP_HOST",
        "REFIT_HTTP_PORT",
        "REFIT_PROBE_PORT",
        "REFIT_REDIS_URL",
        "REFIT_REDIS_PASSWORD",
        "REFIT_REDIS_PASSWORD_FILE",
        "REFIT_AUTH_TOKEN",
        "REFIT_AUTH_TOKEN_FILE",
        "REFIT_TLS_CERT_FILE",
        "REFIT_TLS_KEY_FILE",
        "REFIT_LEASE_TTL_S",
        "REFIT_PREPARE_TIMEOUT_S",
        "REFIT_TRANSFER_TIMEOUT_S",
        "REFIT_GROUP_TIMEOUT_S",
        "REFIT_VERIFY_TIMEOUT_S",
        "REFIT_BUCKET_BYTES",
        "REFIT_NUM_CHANNELS",
        "REFIT_MAX_INFLIGHT_BYTES",
        "REFIT_VERIFY_CHECKSUMS",
        "REFIT_DIRECT_MIN_BYTES",
        "REFIT_DELTA",
        "REFIT_DELTA_MAX_CHANGED",
        "REFIT_SAME_HOST_TRANSPORT",
        "REFIT_ALLOWED_JOBS",
        "REFIT_TRIGGER_RATE_PER_S",
        "REFIT_PAUSE_MODE",
        "REFIT_LOG_LEVEL",
        "REFIT_LOG_JSON",
        "REFIT_ACCESS_LOG",
    }
)
# What agents (trainer ranks, vLLM engine, sidecar) read.
AGENT_ENV = frozenset(
    {
        "REFIT_COORDINATOR",
        "REFIT_COORDINATOR_HTTP",
        "REFIT_AUTH_TOKEN",
        "REFIT_AUTH_TOKEN_FILE",
        "REFIT_TLS_CA_FILE",
        "REFIT_JOB",
        "REFIT_REPLICA_ID",
        "REFIT_VLLM_URL",
        "REFIT_PAUSE_MODE",
        "REFIT_NODE",
        "REFIT_SLEEP_LEVEL",
    }
)

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Rendered:
    """The objects one render produced, plus NOTES.txt."""

    manifests: list[Manifest]
    notes: str

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def get(self, kind: str, name: str) -> Manifest | None:
        for manifest in self.of_kind(kind):
            if manifest["metadata"]["name"] == name:
                return manifest
        return None

    def one(self, kind: str, name: str | None = None) -> Manifest:
        found = [m for m in self.of_kind(kind) if name is None or m["metadata"]["name"] == name]
        if len(found) != 1:
            names = [m["metadata"]["name"] for m in self.of_kind(kind)]
            raise LookupError(f"expected one {kind} named {name!r}, found {names}")
        return found[0]

    def coordinator(self) -> Manifest:
        return self.one("Deployment", RELEASE)

    def coordinator_container(self) -> Manifest:
        return container(self.coordinator(), "coordinator")


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of values (override wins), like repeated `-f` files."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    """Render like `helm install --dry-run` (values validated against values.schema.json)."""
    with helm.Chart.load(CHART_DIR) as chart:
        files = chart.render(
            dict(values or {}), name=release, namespace=namespace, revision=1, is_install=True
        )
    manifests: list[Manifest] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for document in yaml.safe_load_all(text):
            if document:
                manifests.append(document)
    return Rendered(manifests, notes)


def load_yaml_documents(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def load_values(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    return dict(loaded or {})


def pod_spec(workload: Manifest) -> Manifest:
    """The pod spec of a Pod, Deployment, StatefulSet or Job."""
    if workload["kind"] == "Pod":
        return dict(workload["spec"])
    return dict(workload["spec"]["template"]["spec"])


def pod_labels(workload: Manifest) -> dict[str, str]:
    if workload["kind"] == "Pod":
        return dict(workload["metadata"].get("labels", {}))
    return dict(workload["spec"]["template"]["metadata"].get("labels", {}))


WORKLOAD_KINDS = ("Pod", "Deployment", "StatefulSet", "Job", "DaemonSet")


def workloads(manifests: list[Manifest]) -> Iterator[Manifest]:
    return (m for m in manifests if m["kind"] in WORKLOAD_KINDS)


def containers(workload: Manifest) -> list[Manifest]:
    spec = pod_spec(workload)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def container(workload: Manifest, name: str) -> Manifest:
    for candidate in containers(workload):
        if candidate["name"] == name:
            return candidate
    raise LookupError(f"{workload['kind']}/{workload['metadata']['name']} has no container {name}")


def env_of(container_spec: Manifest) -> dict[str, Manifest]:
    """Env entries by name (the whole entry: value or valueFrom)."""
    return {entry["name"]: entry for entry in container_spec.get("env", [])}


def volume_for_mount(workload: Manifest, container_spec: Manifest, path: str) -> Manifest:
    """The pod volume mounted at a directory containing `path` in this container."""
    best: Manifest | None = None
    for mount in container_spec.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and (
            best is None or len(mount["mountPath"]) > len(best["mountPath"])
        ):
            best = mount
    if best is None:
        raise LookupError(f"no volume mounted over {path} in container {container_spec['name']}")
    for volume in pod_spec(workload).get("volumes", []):
        if volume["name"] == best["name"]:
            return dict(volume)
    raise LookupError(f"volumeMount {best['name']} has no volume")


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def image_tag(image: str) -> str | None:
    """The tag of an image reference (None when it has none, i.e. implicitly :latest)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


# The values variants every structural test runs over. Each one is a realistic install.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "bundled-redis-existing-secrets": {
        "auth": {"existingSecret": "my-token", "existingSecretKey": "bearer"},
        "redis": {"bundled": {"auth": {"existingSecret": "my-redis", "existingSecretKey": "pw"}}},
    },
    "bundled-redis-no-persistence": {"redis": {"bundled": {"persistence": {"enabled": False}}}},
    "external-redis": {
        "redis": {
            "bundled": {"enabled": False},
            "external": {
                "enabled": True,
                "url": "rediss://redis.example.internal:6380/2",
                "existingSecret": "ext-redis",
                "existingSecretKey": "password",
            },
        }
    },
    "tls": {"tls": {"enabled": True, "secretName": "coordinator-tls"}},
    "ingress": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "hosts": ["refit.example.com"],
            "tls": [{"secretName": "refit-ingress-tls", "hosts": ["refit.example.com"]}],
        },
        "networkPolicy": {
            "ingressFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
            ]
        },
    },
    "servicemonitor": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "networkPolicy": {
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
            ]
        },
    },
    "networkpolicy-off": {"networkPolicy": {"enabled": False}, "tests": {"enabled": False}},
    "auth-off": {"auth": {"enabled": False}},
    "image-digest": {"image": {"digest": "sha256:" + "ab" * 32}},
}


def example_variants() -> dict[str, dict[str, Any]]:
    """The example values files shipped in deploy/examples, as variants."""
    return {
        f"example:{path.name}": load_values(path)
        for path in sorted(EXAMPLES_DIR.glob("values-*.yaml"))
    }


def all_variants() -> dict[str, dict[str, Any]]:
    return {**VARIANTS, **example_variants()}
