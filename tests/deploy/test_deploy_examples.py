"""The example trainer and vLLM generator pods are wired to what the chart really creates:
the Service address and ports, the auth Secret, the NetworkPolicy's client labels, and the
env contract the agents read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy.chart_support import (
    AGENT_ENV,
    EXAMPLES_DIR,
    Manifest,
    Rendered,
    container,
    containers,
    env_of,
    image_tag,
    load_yaml_documents,
    pod_labels,
    pod_spec,
    render,
    selector_matches,
)
from tests.deploy.dockerfile_support import vllm_plugins

pytestmark = pytest.mark.unit

# The examples assume `helm install refit-coordinator ...` in the agents' namespace.
GENERATOR = EXAMPLES_DIR / "generator-vllm.yaml"
TRAINER = EXAMPLES_DIR / "trainer.yaml"
# Non-REFIT variables the examples may set.
OTHER_ENV_PREFIXES = ("VLLM_", "NCCL_", "HF_", "CUDA_", "TORCH_", "PYTORCH_")


@pytest.fixture(scope="module")
def chart() -> Rendered:
    return render()


def _workload(path: Path, kind: str) -> Manifest:
    (found,) = [d for d in load_yaml_documents(path) if d["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def generator() -> Manifest:
    return _workload(GENERATOR, "StatefulSet")


@pytest.fixture(scope="module")
def trainer() -> Manifest:
    return _workload(TRAINER, "Job")


def _agent_containers(generator: Manifest, trainer: Manifest) -> list[tuple[str, Manifest]]:
    return [(f"generator/{c['name']}", c) for c in containers(generator)] + [
        (f"trainer/{c['name']}", c) for c in containers(trainer)
    ]


def test_agents_point_at_the_chart_service(
    chart: Rendered, generator: Manifest, trainer: Manifest
) -> None:
    service = chart.coordinator()["metadata"]["name"]
    ports = {p["name"]: p["port"] for p in chart.one("Service", service)["spec"]["ports"]}
    for where, c in _agent_containers(generator, trainer):
        env = env_of(c)
        assert env["REFIT_COORDINATOR"]["value"] == f"{service}:{ports['grpc']}", where
        assert env["REFIT_COORDINATOR_HTTP"]["value"] == f"http://{service}:{ports['http']}", where


def test_agents_mount_the_chart_token(
    chart: Rendered, generator: Manifest, trainer: Manifest
) -> None:
    secret = chart.one("Secret", "refit-coordinator-auth")
    for workload in (generator, trainer):
        for c in containers(workload):
            token_path = env_of(c)["REFIT_AUTH_TOKEN_FILE"]["value"]
            mount = next(
                m for m in c["volumeMounts"] if token_path.startswith(m["mountPath"] + "/")
            )
            volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["secretName"] == secret["metadata"]["name"]
            (item,) = volume["secret"]["items"]
            assert item["key"] in secret["data"]
            assert token_path == f"{mount['mountPath']}/{item['path']}"


def test_agents_are_admitted_by_the_chart_network_policy(
    chart: Rendered, generator: Manifest, trainer: Manifest
) -> None:
    policy = chart.one("NetworkPolicy", "refit-coordinator")
    client_peer = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for workload in (generator, trainer):
        assert selector_matches(client_peer, pod_labels(workload)), workload["metadata"]["name"]


def test_refit_group_lets_trainers_and_generators_reach_each_other(
    generator: Manifest, trainer: Manifest
) -> None:
    group = "refitplane.io/refit-group"
    assert pod_labels(generator)[group] == pod_labels(trainer)[group]
    generator_policy = _workload(GENERATOR, "NetworkPolicy")
    trainer_policy = _workload(TRAINER, "NetworkPolicy")
    nccl_rule = generator_policy["spec"]["ingress"][1]
    assert "ports" not in nccl_rule, "NCCL uses ephemeral ports"
    assert selector_matches(nccl_rule["from"][0]["podSelector"]["matchLabels"], pod_labels(trainer))
    assert selector_matches(
        trainer_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"],
        pod_labels(generator),
    )
    # vLLM's port (which also serves the dev-mode weight verbs) is not open to the group
    # alone: only to rollout clients.
    rollout_rule = generator_policy["spec"]["ingress"][0]
    assert rollout_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert not selector_matches(
        rollout_rule["from"][0]["podSelector"]["matchLabels"], pod_labels(trainer)
    )


def test_agent_env_is_the_agent_contract(generator: Manifest, trainer: Manifest) -> None:
    for where, c in _agent_containers(generator, trainer):
        names = set(env_of(c))
        refit = {n for n in names if n.startswith("REFIT_")}
        assert refit <= AGENT_ENV, f"{where}: {sorted(refit - AGENT_ENV)}"
        others = names - refit
        assert all(n.startswith(OTHER_ENV_PREFIXES) for n in others), f"{where}: {others}"
        assert {"REFIT_COORDINATOR", "REFIT_JOB", "REFIT_AUTH_TOKEN_FILE"} <= names, where


def test_one_job_across_the_pods(generator: Manifest, trainer: Manifest) -> None:
    jobs = {env_of(c)["REFIT_JOB"]["value"] for _, c in _agent_containers(generator, trainer)}
    assert len(jobs) == 1


def test_vllm_runs_the_refitplane_engine_in_dev_mode(generator: Manifest) -> None:
    vllm = container(generator, "vllm")
    assert vllm["command"] == ["vllm", "serve"]
    config_args = [a for a in vllm["args"] if a.startswith("--weight-transfer-config=")]
    (config_arg,) = config_args
    config = json.loads(config_arg.partition("=")[2])
    plugins = vllm_plugins()
    assert config == {"backend": "refitplane"}
    assert config["backend"] in plugins
    env = env_of(vllm)
    assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1"
    assert env["NCCL_NVLS_ENABLE"]["value"] == "0"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 2
    tp = next(a for a in vllm["args"] if a.startswith("--tensor-parallel-size="))
    assert int(tp.partition("=")[2]) == vllm["resources"]["limits"]["nvidia.com/gpu"]


def test_sidecar_drives_the_local_vllm(generator: Manifest) -> None:
    vllm = container(generator, "vllm")
    sidecar = container(generator, "refit-sidecar")
    assert sidecar["command"] == ["refit-sidecar"]
    assert sidecar["image"] == vllm["image"], "one generator image for both containers"
    port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    assert f"--port={port}" in vllm["args"]
    env = env_of(sidecar)
    assert env["REFIT_VLLM_URL"]["value"] == f"http://127.0.0.1:{port}"
    assert env["REFIT_PAUSE_MODE"]["value"] in {"keep", "wait", "abort"}
    # Engine ranks and sidecar must report the same replica.
    assert env["REFIT_REPLICA_ID"] == env_of(vllm)["REFIT_REPLICA_ID"]
    assert env["REFIT_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_sidecars_readiness_gates_the_pod(generator: Manifest) -> None:
    """The sidecar's /readyz (not ready while the replica holds incomplete weights, or vLLM
    does not answer) is the pod's readiness too, probed on the port the sidecar listens on."""
    from refitplane.generator.sidecar import SidecarSettings

    sidecar = container(generator, "refit-sidecar")
    probe = sidecar["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"
    (port,) = [p["containerPort"] for p in sidecar["ports"] if p["name"] == probe["port"]]
    listens = env_of(sidecar).get("REFIT_SIDECAR_PORT", {}).get("value")
    assert port == int(listens or SidecarSettings.model_fields["sidecar_port"].default)


@pytest.mark.parametrize("path", [GENERATOR, TRAINER], ids=lambda p: p.name)
def test_example_pods_are_hardened_and_pinned(path: Path) -> None:
    for workload in load_yaml_documents(path):
        if workload["kind"] not in {"StatefulSet", "Job"}:
            continue
        spec = pod_spec(workload)
        assert spec["enableServiceLinks"] is False
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        for c in containers(workload):
            tag = image_tag(c["image"])
            assert tag, c["image"]
            assert tag != "latest", c["image"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        shm = [v for v in spec["volumes"] if v["name"] == "shm"]
        assert shm, "NCCL and vLLM TP need a large /dev/shm"
        assert shm[0]["emptyDir"]["medium"] == "Memory"
