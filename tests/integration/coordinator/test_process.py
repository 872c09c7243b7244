"""The coordinator as a real process: flags and REFIT_* variables, port files, SIGTERM,
TLS on both transports, the console script, and stale generated stubs."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from refitplane.errors import Unauthenticated
from refitplane.protocol import RefitState
from tests.support.processes import run_to_end
from tests.support.tls_certs import certificate, new_key, write_certificate, write_key

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def test_generated_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_env_and_flags_configure_the_process(coordinator_process, sim_cluster, tmp_path, redis_url):
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    proc = coordinator_process(
        "--redis-url",
        redis_url,
        env={
            "REFIT_AUTH_TOKEN": "env-token",
            "REFIT_AUTH_TOKEN_FILE": str(token_file),
            "REFIT_ALLOWED_JOBS": "job, other",
            "REFIT_LOG_JSON": "true",
            "REFIT_NUM_CHANNELS": "3",
        },
    )
    cluster = sim_cluster(proc, token="file-token")
    cluster.trainers(world=1)
    cluster.replica("a")
    client = cluster.client()
    refit = client.wait(client.trigger("job").refit_id, timeout_s=15)
    assert refit.state is RefitState.COMMITTED
    from refitplane.protocol.messages import JoinGroupCmd

    assert cluster.members[0].agent.received(JoinGroupCmd)[0].num_channels == 3
    with httpx.Client(base_url=proc.http_url, timeout=5) as http:
        assert http.get("/readyz").status_code == 200
        assert (
            http.post(
                "/v1/jobs/job/refits", headers={"Authorization": "Bearer env-token"}
            ).status_code
            == 401
        )
    assert proc.terminate() == 0
    log = proc.log()
    assert '"level": "INFO"' in log  # JSON lines
    # The access log: one line per request, its fields as JSON keys.
    assert '"transport": "grpc", "method": "/refit.v1.RefitService/TriggerRefit"' in log
    assert (
        '"transport": "http", "method": "POST", "target": "/v1/jobs/job/refits", "status": "401"'
        in log
    )
    assert "file-token" not in log
    assert "env-token" not in log
    assert "(embedded store)" not in log
    assert "redis://127.0.0.1" in log


def test_invalid_configuration_exits_with_a_message(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
    env |= {"REFIT_BUCKET_BYTES": "1024", "REFIT_MAX_INFLIGHT_BYTES": "10", "PYTHONPATH": ""}
    from tests.integration.conftest import COORDINATOR_MODULE

    argv = [sys.executable, *COORDINATOR_MODULE, "--env-file", str(tmp_path / "none")]
    result = run_to_end(argv, env=env, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "refit-coordinator: invalid configuration: REFIT_MAX_INFLIGHT_BYTES: max_inflight_bytes "
        "(10) must be at least bucket_bytes (1024)"
    ]


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost (also a CA: clients trust it as their root)
    and its key, as PEM files."""
    key = new_key()
    cert = certificate(key, "localhost", ca=True, localhost=True)
    return write_certificate(tmp_path / "tls.crt", cert), write_key(tmp_path / "tls.key", key)


def test_tls_on_grpc_and_http(coordinator_factory, sim_cluster, tmp_path):
    cert, key = _self_signed(tmp_path)
    coord = coordinator_factory(
        tls_cert_file=str(cert), tls_key_file=str(key), auth_token="tls-token"
    )
    cluster = sim_cluster(coord, token="tls-token", tls_ca=cert)
    cluster.trainers(world=1)
    cluster.replica("a")
    client = cluster.client()
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).state is RefitState.COMMITTED
    with httpx.Client(
        base_url=coord.http_url, verify=ssl.create_default_context(cafile=str(cert)), timeout=5
    ) as http:
        assert coord.http_url.startswith("https://")
        assert http.get("/healthz").status_code == 200
        resp = http.post("/v1/jobs/job/refits", headers={"Authorization": "Bearer tls-token"})
        assert resp.status_code == 202
    from refitplane.client import RefitClient

    with RefitClient(coord.grpc_target, tls_ca=cert) as no_token, pytest.raises(Unauthenticated):
        no_token.trigger("job")


def test_sigterm_stops_gracefully(coordinator_process):
    proc = coordinator_process()
    with httpx.Client(base_url=proc.http_url, timeout=5) as http:
        assert http.get("/healthz").status_code == 200
    assert proc.terminate(timeout_s=15) == 0
    assert "stopping gracefully" in proc.log()
    assert "coordinator stopped" in proc.log()


def test_console_script_help():
    exe = shutil.which("refit-coordinator")
    assert exe is not None, "the refit-coordinator console script is not installed"
    result = subprocess.run(
        [exe, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0
    for flag in ("--http-port", "--grpc-port", "--redis-url"):
        assert flag in result.stdout
