"""`refit-sidecar` as a real process: SIGTERM / SIGINT stop it within seconds while it waits
for a vLLM that never becomes healthy (it used to wait out REFIT_VLLM_START_TIMEOUT_S, 900 s
by default, ignoring both), a health port in use is one line, a bad flag is refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refitplane.testing.child_processes import free_port
from refitplane.version import __version__
from tests.support.processes import killed_at_exit, run_to_end, stop_with, wait_for_line

pytestmark = pytest.mark.integration

SIDECAR_MODULE = ("-m", "refitplane.generator.sidecar_main")
# The property is "within 5 s"; the margin absorbs a loaded 2-core machine.
STOP_BOUND_S = 5.0
MARGIN_S = 10.0


def _command(*extra: str) -> list[str]:
    return [
        sys.executable, *SIDECAR_MODULE,
        "--coordinator", f"127.0.0.1:{free_port()}",  # nothing listens: never reached
        "--job", "job", "--replica-id", "a",
        "--vllm-url", f"http://127.0.0.1:{free_port()}",  # never healthy
        *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
    return env | {"REFIT_SIDECAR_HOST": "127.0.0.1"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_it_while_waiting_for_vllm(tmp_path: Path, signum: signal.Signals):
    log_path = tmp_path / "sidecar.log"
    json_logs = signum == signal.SIGINT  # one of the two runs logs JSON lines (REFIT_LOG_JSON)
    env = _env() | ({"REFIT_LOG_JSON": "true"} if json_logs else {})
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _command("--sidecar-port", "0"), env=env, cwd=tmp_path, stdout=log, stderr=log
        )
    with killed_at_exit(proc):
        wait_for_line(proc, log_path, "waiting for vLLM", timeout_s=60, what="the sidecar")
        time.sleep(1.0)  # well inside the wait loop
        signalled = time.monotonic()
        code = stop_with(proc, signum, timeout_s=STOP_BOUND_S + MARGIN_S)
        took = time.monotonic() - signalled
    text = log_path.read_text()
    assert code == 0, text
    assert f"{signum.name} received: stopping" in text
    assert "stopped" in text
    if json_logs:
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert {"ts", "level", "logger", "message"} <= set(lines[-1])
        assert any(d["message"] == f"{signum.name} received: stopping" for d in lines)
    print(f"stopped {took:.2f} s after {signum.name}")


def test_health_port_in_use_is_one_line(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_to_end(_command("--sidecar-port", str(port)), env=_env(), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"refit-sidecar: cannot start: cannot listen for health checks on 127.0.0.1:{port}: "
        "address already in use (is another instance running?); choose another with "
        "--sidecar-port / REFIT_SIDECAR_PORT"
    ]


def test_bad_pause_mode_and_version(tmp_path: Path):
    result = run_to_end(_command("--pause-mode", "bogus"), env=_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "refit-sidecar: invalid configuration: REFIT_PAUSE_MODE: should be 'keep', 'wait' or "
        "'abort' (got 'bogus')"
    ]
    result = run_to_end([sys.executable, *SIDECAR_MODULE, "--version"])
    assert result.stdout.strip() == f"refit-sidecar {__version__}"
