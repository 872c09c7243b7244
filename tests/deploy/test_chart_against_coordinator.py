"""The chart against the real coordinator: the environment it renders is accepted by the
coordinator's settings object, and the `helm test` script passes against a running
coordinator process. Both need `refitplane.coordinator` importable from the installed
distribution; they are skipped, saying so, where it is not."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart_support import CHART_DIR, all_variants, env_of, render

SCRIPT = CHART_DIR / "files" / "healthcheck.py"


def _coordinator_module(name: str) -> Any:
    try:
        found = importlib.util.find_spec("refitplane.coordinator") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip(
            "refitplane.coordinator is not importable from the installed package "
            "(services/coordinator is not packaged yet)"
        )
    return importlib.import_module(name)


@pytest.mark.unit
@pytest.mark.parametrize("variant", list(all_variants()))
def test_rendered_env_is_accepted_by_the_coordinator_settings(
    variant: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings_module = _coordinator_module("refitplane.coordinator.settings")
    env = env_of(render(all_variants()[variant]).coordinator_container())
    for name in list(os.environ):
        if name.startswith("REFIT_"):
            monkeypatch.delenv(name)
    for name, entry in env.items():
        # Secrets come from the cluster: any value of the right shape stands in for them.
        monkeypatch.setenv(name, entry.get("value", "stand-in-secret"))
    monkeypatch.chdir(tmp_path)  # no stray .env
    settings = settings_module.Settings()
    assert settings.grpc_port == int(env["REFIT_GRPC_PORT"]["value"])
    assert settings.http_port == int(env["REFIT_HTTP_PORT"]["value"])
    assert settings.probe_port == int(env["REFIT_PROBE_PORT"]["value"])
    assert settings.redis_url == env["REFIT_REDIS_URL"]["value"]
    assert settings.pause_mode.value == env["REFIT_PAUSE_MODE"]["value"]
    assert settings.bucket_bytes == int(env["REFIT_BUCKET_BYTES"]["value"])
    assert settings.same_host_transport == env["REFIT_SAME_HOST_TRANSPORT"]["value"]
    assert settings.tls == ("REFIT_TLS_CERT_FILE" in env)
    assert (settings.auth_token_file is not None) == ("REFIT_AUTH_TOKEN_FILE" in env)


@dataclass
class CoordinatorProcess:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    probe_port: int
    log: Path


@contextlib.contextmanager
def coordinator_process(workdir: Path, token: Path) -> Iterator[CoordinatorProcess]:
    """`python -m refitplane.coordinator` on free loopback ports, embedded store, auth on."""
    port_file = workdir / "ports.json"
    log = workdir / "coordinator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")} | {
        "REFIT_GRPC_HOST": "127.0.0.1",
        "REFIT_HTTP_HOST": "127.0.0.1",
        "REFIT_AUTH_TOKEN_FILE": str(token),
    }
    command = [sys.executable, "-m", "refitplane.coordinator", "--port-file", str(port_file)]
    command += ["--grpc-port", "0", "--http-port", "0", "--probe-port", "0", "--lane-port", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"coordinator did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        yield CoordinatorProcess(
            proc, ports["grpc_port"], ports["http_port"], ports["probe_port"], log
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.integration
def test_helm_test_script_passes_against_the_real_coordinator(tmp_path: Path) -> None:
    _coordinator_module("refitplane.coordinator.__main__")
    token = tmp_path / "token"
    token.write_text("helm-test-token\n")
    with coordinator_process(tmp_path, token) as coordinator:
        command = [sys.executable, str(SCRIPT), "--timeout", "10", "--token-file", str(token)]
        command += ["--http", f"http://127.0.0.1:{coordinator.http_port}"]
        command += ["--grpc", f"127.0.0.1:{coordinator.grpc_port}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        log = coordinator.log.read_text(errors="replace")
        assert result.returncode == 0, result.stdout + result.stderr + log
        assert "coordinator healthy" in result.stdout
        # The paths the chart's probes GET, on the probe port.
        for path in ("/healthz", "/readyz"):
            url = f"http://127.0.0.1:{coordinator.probe_port}{path}"
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200, path
        # SIGTERM (what the kubelet sends) stops it gracefully within the grace period.
        coordinator.proc.send_signal(signal.SIGTERM)
        assert coordinator.proc.wait(timeout=30) == 0
