"""`refitctl demo` stopped by SIGTERM while vLLM starts (the longest wait of the demo):
it exits 130 within seconds saying so, and leaves no process behind (its coordinator, vLLM
server and engine core are killed with their process groups)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.vllm_marks import VLLM_CPU
from tests.support.processes import killed_at_exit, stop_with, wait_for_line

pytestmark = VLLM_CPU

# The property is "within seconds" (3 s per child, then SIGKILL); the margin absorbs a
# loaded 2-core machine.
STOP_BOUND_S = 30.0


def _processes_mentioning(text: str, *, besides: int = -1) -> list[str]:
    ps = subprocess.run(
        ["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True, timeout=10, check=True
    )
    return [
        line
        for line in ps.stdout.splitlines()
        if text in line and "ps -eww" not in line and int(line.split()[0]) != besides
    ]


def test_sigterm_while_vllm_starts_stops_everything(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    log_path = tmp_path / "demo.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
    with log_path.open("wb") as log:
        demo = subprocess.Popen(
            [sys.executable, "-m", "refitplane.cli.refitctl", "demo", "--model", "dense",
             "--steps", "1", "--workdir", str(workdir)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    with killed_at_exit(demo):
        wait_for_line(demo, log_path, "starting vLLM", timeout_s=300, what="the demo")
        children = _processes_mentioning(str(workdir), besides=demo.pid)
        assert children, "no child process to stop"  # the coordinator and vLLM, at least
        code = stop_with(demo, signal.SIGTERM, timeout_s=STOP_BOUND_S)
    text = log_path.read_text()
    assert code == 130, text
    assert "refitctl: interrupted (SIGTERM)" in text
    assert "[demo] interrupted: stopped its processes" in text
    assert "Traceback" not in text
    assert _processes_mentioning(str(workdir)) == []
