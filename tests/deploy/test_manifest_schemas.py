"""Every rendered manifest (all variants, the examples) against Kubernetes' own OpenAPI
schemas (kubernetes-validate, strict: unknown fields fail), on the chart's minimum and the
newest Kubernetes version; and `helm lint --strict` on the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from kubernetes_validate.utils import schema_contents

from tests.deploy.chart_support import (
    CHART_DIR,
    EXAMPLES_DIR,
    MIN_KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    Manifest,
    all_variants,
    load_yaml_documents,
    render,
)

pytestmark = pytest.mark.unit

LATEST_KUBE_VERSION = kubernetes_validate.latest_version()
KUBE_VERSIONS = (MIN_KUBE_VERSION, LATEST_KUBE_VERSION)

# Custom resources have no schema in kubernetes-validate. They are skipped there, by name,
# and checked against the subset of their CRD this chart emits (below).
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"


def _ref(definition: str) -> dict[str, str]:
    return {"$ref": f"{DEFINITIONS_ID}#/$defs/{definition}"}


# The ServiceMonitor fields the chart renders (prometheus-operator monitoring.coreos.com/v1),
# closed with additionalProperties so a typo fails; metadata and selector use Kubernetes'
# own definitions.
SERVICE_MONITOR_SUBSET: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": _ref("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scheme": {"enum": ["http", "https"]},
                            "tlsConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "serverName": {"type": "string"},
                                    "ca": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "secret": _ref("io.k8s.api.core.v1.SecretKeySelector")
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def _validate_crd_subset(manifest: Manifest, version: str) -> None:
    definitions = schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version
    )
    registry: referencing.Registry[Any] = referencing.Registry().with_resource(
        DEFINITIONS_ID, referencing.Resource.from_contents(definitions)
    )
    validator = jsonschema.Draft202012Validator(SERVICE_MONITOR_SUBSET, registry=registry)
    validator.validate(manifest)


def _validate(manifest: Manifest, source: str) -> list[str]:
    """Validate one object on every KUBE_VERSION; returns what was checked, for the record."""
    kind = (manifest["apiVersion"], manifest["kind"])
    name = f"{source}: {manifest['kind']}/{manifest['metadata']['name']}"
    checked = []
    for version in KUBE_VERSIONS:
        if kind in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(manifest, version, strict=True)
            _validate_crd_subset(manifest, version)
        else:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{name} invalid on Kubernetes {version}: {path}: {exc.message}")
        checked.append(f"{name}@{version}")
    return checked


@pytest.mark.parametrize("variant", list(all_variants()))
def test_rendered_manifests_are_valid_kubernetes(variant: str) -> None:
    rendered = render(all_variants()[variant])
    assert rendered.manifests
    for manifest in rendered.manifests:
        _validate(manifest, variant)


# values-*.yaml are chart values: the variant tests render them through the chart.
EXAMPLE_MANIFESTS = sorted(
    p.name for p in EXAMPLES_DIR.glob("*.yaml") if not p.name.startswith("values-")
)


@pytest.mark.parametrize("example", EXAMPLE_MANIFESTS)
def test_example_manifests_are_valid_kubernetes(example: str) -> None:
    documents = load_yaml_documents(EXAMPLES_DIR / example)
    assert documents
    for manifest in documents:
        _validate(manifest, example)


def test_validation_catches_an_invalid_field() -> None:
    """The validator is strict on this kubernetes-validate version (guards the tests above)."""
    deployment = render().coordinator()
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, LATEST_KUBE_VERSION, strict=True)
    deployment = render().coordinator()
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, LATEST_KUBE_VERSION, strict=True)


def test_crd_subset_catches_a_typo() -> None:
    rendered = render(all_variants()["servicemonitor"])
    monitor = rendered.one("ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd_subset(monitor, LATEST_KUBE_VERSION)


@pytest.mark.parametrize("variant", list(all_variants()))
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_helm_lint_strict(variant: str, kube_version: str) -> None:
    helm.disable_logging()
    report = helm.lint(
        CHART_DIR, all_variants()[variant], strict=True, kube_version=f"v{kube_version}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, problems
    assert not report["errors"], report["errors"]
    assert report["total_charts_linted"] == 1


def test_helm_lint_reports_schema_violations() -> None:
    helm.disable_logging()
    report = helm.lint(CHART_DIR, {"replicas": 3}, strict=True)
    assert any("replicas" in error for error in report["errors"])


def test_packaged_chart_renders_the_same(tmp_path: Path) -> None:
    """`helm package` keeps everything the templates need (files/, schema) and nothing else."""
    archive = helm.package(CHART_DIR, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        names = {f["name"] for f in packaged.files}
        assert "files/healthcheck.py" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        assert packaged.schema is not None
        rendered = packaged.render({}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    kinds = sorted(
        (doc["kind"], doc["metadata"]["name"])
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    )
    assert kinds == sorted((m["kind"], m["metadata"]["name"]) for m in render().manifests)
