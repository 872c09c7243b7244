"""Run a command to its end, the way the process tests read it (text, both streams), or
wait for a running one to log a line."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def run_to_end(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def wait_for_line(
    proc: subprocess.Popen[bytes], log: Path, text: str, *, timeout_s: float, what: str
) -> None:
    """Poll `log` (the process's output) until it contains `text`; fail if the process
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"{what} exited:\n{log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"{what} never logged {text!r} in {timeout_s:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """Whatever the test does with `proc`, it does not outlive the block."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def stop_with(proc: subprocess.Popen[bytes], signum: int, *, timeout_s: float) -> int:
    """Send `signum` and return the exit status; fails the test after `timeout_s`."""
    proc.send_signal(signum)
    return proc.wait(timeout=timeout_s)
