"""What the rendered chart must guarantee, for the defaults and every variant: pinned images,
locked-down pods, resolvable secrets, selectors, the coordinator's settings contract, its
Deployment (probes, termination, auth, TLS), its PodDisruptionBudget, the helm test pod and
the NOTES. Redis is test_helm_chart_redis.py's, how the coordinator is reached
test_helm_chart_network.py's."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
import yaml

from tests.deploy.chart_support import (
    CHART_DIR,
    COORDINATOR_ENV,
    NAMESPACE,
    RELEASE,
    Rendered,
    all_variants,
    container,
    containers,
    env_of,
    image_tag,
    pod_labels,
    pod_spec,
    render,
    selector_matches,
    volume_for_mount,
    workloads,
)

pytestmark = pytest.mark.unit

APP_VERSION = str(yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"])


@pytest.fixture(scope="module")
def rendered_variants() -> dict[str, Rendered]:
    return {name: render(values) for name, values in all_variants().items()}


def _variant_ids() -> list[str]:
    return list(all_variants())


# --- invariants over every variant -------------------------------------------------------


@pytest.mark.parametrize("variant", _variant_ids())
def test_every_image_is_pinned(rendered_variants: dict[str, Rendered], variant: str) -> None:
    for workload in workloads(rendered_variants[variant].manifests):
        for spec in containers(workload):
            tag = image_tag(spec["image"])
            assert tag, f"{workload['metadata']['name']}/{spec['name']}: {spec['image']} has no tag"
            assert tag != "latest", f"{spec['name']} uses {spec['image']}"


@pytest.mark.parametrize("variant", _variant_ids())
def test_every_pod_is_locked_down(rendered_variants: dict[str, Rendered], variant: str) -> None:
    for workload in workloads(rendered_variants[variant].manifests):
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        spec = pod_spec(workload)
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, where
        assert pod_sc["runAsUser"] != 0, where
        assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec["automountServiceAccountToken"] is False, where
        assert spec["enableServiceLinks"] is False, where
        for c in containers(workload):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, f"{where}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False, f"{where}/{c['name']}"
            assert sc["capabilities"]["drop"] == ["ALL"], f"{where}/{c['name']}"
            assert "tcpSocket" not in str(c), f"{where}/{c['name']} uses a tcpSocket probe"
            assert c["resources"].get("requests"), f"{where}/{c['name']} has no requests"
            assert c["resources"].get("limits", {}).get("memory"), f"{where}/{c['name']}"


@pytest.mark.parametrize("variant", _variant_ids())
def test_secret_references_resolve(rendered_variants: dict[str, Rendered], variant: str) -> None:
    """Every Secret a pod uses is rendered by the chart with that key, or is one the user
    named in values (existingSecret / tls.secretName), never an invented name."""
    values = all_variants()[variant]
    rendered = rendered_variants[variant]
    user_secrets = _user_secret_names(values)
    for workload in workloads(rendered.manifests):
        refs: list[tuple[str, str | None]] = []
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume:
                for item in volume["secret"].get("items", [{"key": None}]):
                    refs.append((volume["secret"]["secretName"], item["key"]))
        for c in containers(workload):
            for entry in c.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append((ref["name"], ref["key"]))
        for name, key in refs:
            secret = rendered.get("Secret", name)
            if secret is None:
                assert name in user_secrets, f"{workload['metadata']['name']} uses Secret {name}"
            elif key is not None:
                assert key in secret["data"], f"Secret {name} has no key {key}"


def _user_secret_names(values: dict[str, Any]) -> set[str]:
    names = {
        values.get("auth", {}).get("existingSecret"),
        values.get("tls", {}).get("secretName"),
        values.get("tls", {}).get("caSecretName"),
        values.get("redis", {}).get("bundled", {}).get("auth", {}).get("existingSecret"),
        values.get("redis", {}).get("external", {}).get("existingSecret"),
    }
    return {n for n in names if n}


@pytest.mark.parametrize("variant", _variant_ids())
def test_selectors_match_their_pods(rendered_variants: dict[str, Rendered], variant: str) -> None:
    rendered = rendered_variants[variant]
    pods = [(w, pod_labels(w)) for w in workloads(rendered.manifests) if w["kind"] != "Pod"]
    for service in rendered.of_kind("Service"):
        matched = [w for w, labels in pods if selector_matches(service["spec"]["selector"], labels)]
        assert len(matched) == 1, f"Service {service['metadata']['name']} selects {len(matched)}"
        targets = {p["name"] for c in containers(matched[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in targets, f"{service['metadata']['name']}:{port['name']}"
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in rendered.of_kind(kind):
            selector = (obj["spec"].get("selector") or obj["spec"]["podSelector"])["matchLabels"]
            assert any(selector_matches(selector, labels) for _, labels in pods), (
                f"{kind} {obj['metadata']['name']} selects no pod"
            )


@pytest.mark.parametrize("variant", _variant_ids())
def test_coordinator_env_is_the_settings_contract(
    rendered_variants: dict[str, Rendered], variant: str
) -> None:
    env = env_of(rendered_variants[variant].coordinator_container())
    unknown = {name for name in env if name.startswith("REFIT_")} - COORDINATOR_ENV
    assert not unknown, f"not coordinator settings: {sorted(unknown)}"


# --- the coordinator Deployment ----------------------------------------------------------


def test_single_replica_recreated_never_surged(default: Rendered) -> None:
    deployment = default.coordinator()
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_image_defaults_to_app_version(default: Rendered) -> None:
    image = default.coordinator_container()["image"]
    assert image == f"ghcr.io/refitplane/refit-coordinator:{APP_VERSION}"


def test_image_digest_pins_by_digest() -> None:
    digest = "sha256:" + "ab" * 32
    image = render({"image": {"digest": digest, "tag": "0.1.0"}}).coordinator_container()["image"]
    assert image.endswith(f":0.1.0@{digest}")


def test_probes_are_http_gets_on_the_probe_port(default: Rendered) -> None:
    c = default.coordinator_container()
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "probe"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probe"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probe"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "lane": 50052, "http": 8080, "probe": 8081}
    assert env_of(c)["REFIT_PROBE_PORT"]["value"] == "8081"


def test_graceful_termination(default: Rendered) -> None:
    spec = pod_spec(default.coordinator())
    assert spec["terminationGracePeriodSeconds"] == 30
    pre_stop = default.coordinator_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["sleep", "5"]


def test_settings_env(default: Rendered) -> None:
    env = env_of(default.coordinator_container())
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    assert plain["REFIT_GRPC_PORT"] == "50051"
    assert plain["REFIT_HTTP_PORT"] == "8080"
    assert plain["REFIT_REDIS_URL"] == f"redis://{RELEASE}-redis:6379/0"
    assert plain["REFIT_BUCKET_BYTES"] == str(64 * 2**20)
    assert plain["REFIT_MAX_INFLIGHT_BYTES"] == str(256 * 2**20)
    assert plain["REFIT_PAUSE_MODE"] == "keep"
    assert plain["REFIT_VERIFY_CHECKSUMS"] == "true"
    assert plain["REFIT_DIRECT_MIN_BYTES"] == str(16 * 2**20)
    assert "REFIT_AUTH_TOKEN" not in env, "the token must come from a mounted file"
    assert "REFIT_TRIGGER_RATE_PER_S" not in env, "null keeps the coordinator's default"


def test_settings_overrides_reach_env() -> None:
    values = {
        "coordinator": {
            "allowedJobs": ["a", "b"],
            "triggerRatePerS": 0.5,
            "verifyTimeoutS": 45,
            "bucketBytes": 2**30,
            "pauseMode": "abort",
        }
    }
    env = env_of(render(values).coordinator_container())
    assert env["REFIT_ALLOWED_JOBS"]["value"] == "a,b"
    assert env["REFIT_TRIGGER_RATE_PER_S"]["value"] == "0.5"
    assert env["REFIT_VERIFY_TIMEOUT_S"]["value"] == "45"
    assert env["REFIT_BUCKET_BYTES"]["value"] == str(2**30)
    assert env["REFIT_PAUSE_MODE"]["value"] == "abort"


def test_auth_token_is_a_mounted_generated_secret(default: Rendered) -> None:
    deployment = default.coordinator()
    c = default.coordinator_container()
    token_path = env_of(c)["REFIT_AUTH_TOKEN_FILE"]["value"]
    volume = volume_for_mount(deployment, c, token_path)
    secret = default.one("Secret", volume["secret"]["secretName"])
    assert volume["secret"]["items"] == [{"key": "token", "path": token_path.rsplit("/", 1)[1]}]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)


def test_existing_auth_secret_is_used_not_generated() -> None:
    rendered = render({"auth": {"existingSecret": "my-token", "existingSecretKey": "bearer"}})
    assert rendered.get("Secret", f"{RELEASE}-auth") is None
    c = rendered.coordinator_container()
    volume = volume_for_mount(
        rendered.coordinator(), c, env_of(c)["REFIT_AUTH_TOKEN_FILE"]["value"]
    )
    assert volume["secret"]["secretName"] == "my-token"
    assert volume["secret"]["items"][0]["key"] == "bearer"


def test_auth_off_mounts_no_token() -> None:
    rendered = render({"auth": {"enabled": False}})
    assert "REFIT_AUTH_TOKEN_FILE" not in env_of(rendered.coordinator_container())
    assert rendered.get("Secret", f"{RELEASE}-auth") is None
    assert "auth.enabled=false" in rendered.notes


def test_writable_tmp_only(default: Rendered) -> None:
    c = default.coordinator_container()
    volume = volume_for_mount(default.coordinator(), c, "/tmp/x")
    assert "emptyDir" in volume


# --- TLS ---------------------------------------------------------------------------------


def test_tls_mounts_certificate_and_keeps_plain_probes() -> None:
    rendered = render({"tls": {"enabled": True, "secretName": "coordinator-tls"}})
    c = rendered.coordinator_container()
    env = env_of(c)
    for var, key in (("REFIT_TLS_CERT_FILE", "tls.crt"), ("REFIT_TLS_KEY_FILE", "tls.key")):
        volume = volume_for_mount(rendered.coordinator(), c, env[var]["value"])
        assert volume["secret"]["secretName"] == "coordinator-tls"
        assert {"key": key, "path": key} in volume["secret"]["items"]
    # The probe port speaks plain HTTP whatever REFIT_TLS_*: the probes stay as they are.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == "probe"
        assert "scheme" not in c[probe]["httpGet"]
    test_pod = rendered.one("Pod")
    command = container(test_pod, "healthcheck")["command"]
    assert command[command.index("--http") + 1].startswith("https://")
    assert "--ca-file" in command
    assert f"REST     https://{RELEASE}.{NAMESPACE}.svc:8080" in rendered.notes


def test_tls_servicemonitor_verifies_with_the_ca() -> None:
    rendered = render(
        {
            "tls": {"enabled": True, "secretName": "coordinator-tls"},
            "serviceMonitor": {"enabled": True},
            "networkPolicy": {"metricsFrom": [{"podSelector": {}}]},
        }
    )
    endpoint = rendered.one("ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "coordinator-tls", "key": "ca.crt"}
    assert endpoint["tlsConfig"]["serverName"] == f"{RELEASE}.{NAMESPACE}.svc"


# --- PodDisruptionBudget -----------------------------------------------------------------


def test_pdb_protects_the_coordinator(default: Rendered) -> None:
    pdb = default.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 0
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert selector_matches(
        pdb["spec"]["selector"]["matchLabels"], pod_labels(default.coordinator())
    )


def test_pdb_min_available_replaces_max_unavailable() -> None:
    pdb = render({"podDisruptionBudget": {"minAvailable": 1}}).one("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in pdb["spec"]


# --- helm test, NOTES ----------------------------------------------------------------------


def test_helm_test_pod_runs_the_shipped_healthcheck(default: Rendered) -> None:
    pod = default.one("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = container(pod, "healthcheck")
    assert c["image"] == default.coordinator_container()["image"]
    command = c["command"]
    assert command[:2] == ["python", "/opt/refit-test/healthcheck.py"]
    assert command[command.index("--http") + 1] == f"http://{RELEASE}.{NAMESPACE}.svc:8080"
    assert command[command.index("--grpc") + 1] == f"{RELEASE}.{NAMESPACE}.svc:50051"
    token_file = command[command.index("--token-file") + 1]
    assert volume_for_mount(pod, c, token_file)["secret"]["secretName"] == f"{RELEASE}-auth"
    script_volume = volume_for_mount(pod, c, command[1])
    config_map = default.one("ConfigMap", script_volume["configMap"]["name"])
    shipped = (CHART_DIR / "files" / "healthcheck.py").read_text()
    assert config_map["data"]["healthcheck.py"] == shipped


def test_notes_explain_how_to_reach_and_trigger(default: Rendered) -> None:
    notes = default.notes
    assert f"REFIT_COORDINATOR={RELEASE}.{NAMESPACE}.svc:50051" in notes
    assert f"port-forward svc/{RELEASE} 8080:8080 50051:50051" in notes
    assert '"$REFIT_COORDINATOR_HTTP/v1/jobs/my-job/refits"' in notes
    assert "refitctl trigger --job my-job" in notes
    assert "refitctl status <refit id> --watch" in notes
    assert f"helm test {RELEASE}" in notes
    assert "refitplane.io/client=true" in notes


def test_release_name_containing_chart_name_is_not_doubled() -> None:
    rendered = render(release="team-a")
    assert rendered.get("Deployment", "team-a-refit-coordinator") is not None
    assert rendered.get("StatefulSet", "team-a-refit-coordinator-redis") is not None
