"""`refit-coordinator` refuses to start with one line naming what and where: a gRPC, HTTP
or probe port another coordinator listens on (gRPC's SO_REUSEPORT default would let both listen),
an unreachable Redis (named by its URL, password redacted); and SIGTERM stops it during
start-up too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from refitplane.testing.child_processes import free_port
from refitplane.version import __version__
from tests.integration.conftest import COORDINATOR_MODULE
from tests.support.processes import killed_at_exit, run_to_end, stop_with

pytestmark = pytest.mark.integration


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
    env |= {"REFIT_GRPC_HOST": "127.0.0.1", "REFIT_HTTP_HOST": "127.0.0.1", "REFIT_LANE_PORT": "0"}
    argv = [sys.executable, *COORDINATOR_MODULE, "--env-file", str(tmp_path / "no.env"), *args]
    return run_to_end(argv, env=env, cwd=tmp_path)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("refit-coordinator: cannot start: ")
    return lines[0]


def test_grpc_port_in_use_is_refused(coordinator_process, tmp_path):
    first = coordinator_process()
    result = _run(tmp_path, "--grpc-port", str(first.grpc_port), "--http-port", "0")
    assert result.returncode == 1
    line = _one_line(result)
    assert f"gRPC on 127.0.0.1:{first.grpc_port}: address already in use" in line
    assert "--grpc-port / REFIT_GRPC_PORT" in line
    with httpx.Client(base_url=first.http_url, timeout=5) as http:
        assert http.get("/readyz").status_code == 200
    assert first.terminate() == 0


def test_http_port_in_use_is_refused(coordinator_process, tmp_path):
    first = coordinator_process()
    result = _run(tmp_path, "--grpc-port", "0", "--http-port", str(first.http_port))
    assert result.returncode == 1
    line = _one_line(result)
    assert f"HTTP on 127.0.0.1:{first.http_port}: address already in use" in line
    assert "--http-port / REFIT_HTTP_PORT" in line


def test_probe_port_in_use_is_refused(coordinator_process, tmp_path):
    first = coordinator_process()
    taken = first.http_port  # any port something listens on
    result = _run(tmp_path, "--grpc-port", "0", "--http-port", "0", "--probe-port", str(taken))
    assert result.returncode == 1
    line = _one_line(result)
    assert f"probes on 127.0.0.1:{taken}: address already in use" in line
    assert "--probe-port / REFIT_PROBE_PORT" in line


def test_unreachable_redis_names_the_url_not_the_password(tmp_path):
    port = free_port()  # nothing listens there
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    result = _run(tmp_path, "--grpc-port", "0", "--http-port", "0", "--redis-url", url)
    assert result.returncode == 1
    line = _one_line(result)
    assert f"redis://***@127.0.0.1:{port}/0" in line
    assert "--redis-url / REFIT_REDIS_URL" in line
    assert "hunter2" not in result.stderr + result.stdout


def test_version(tmp_path):
    result = _run(tmp_path, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"refit-coordinator {__version__}"


def test_sigterm_while_the_store_does_not_answer_stops_it(tmp_path):
    """A Redis that accepts connections and never answers holds start-up for ~20 s (5 s
    socket timeout, 3 retries); SIGTERM must not wait for that."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nothing ever answers
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
        log_path = tmp_path / "coordinator.log"
        argv = [sys.executable, *COORDINATOR_MODULE, "--env-file", str(tmp_path / "no.env"),
                "--grpc-port", "0", "--http-port", "0", "--lane-port", "0", "--redis-url", url]  # fmt: skip
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=log)
        with killed_at_exit(proc):
            # Its first connection to the store means start-up has reached the store's first
            # PING, after the signal handlers are installed (a fixed sleep raced them on a
            # loaded machine: the SIGTERM came first and the process died of it, -15).
            silent.settimeout(60.0)
            held, _ = silent.accept()
            assert proc.poll() is None, log_path.read_text()
            code = stop_with(proc, signal.SIGTERM, timeout_s=12)
        held.close()
    text = log_path.read_text()
    assert code == 0, text
    assert "SIGTERM received: stopping" in text
    assert "Traceback" not in text


def test_invalid_settings_are_one_line_naming_each_variable(tmp_path):
    result = _run(tmp_path, "--grpc-port", "99999", "--log-level", "loud")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "refit-coordinator: invalid configuration: REFIT_GRPC_PORT: should be less than or "
        "equal to 65535 (got 99999); REFIT_LOG_LEVEL: unknown log level 'loud'"
    ]
