"""The processes of a refit deployment, each a child a test may kill (SIGKILL), freeze
(SIGSTOP), restart or stop: `Proc` (any child, restartable with the same arguments), and
`RedisProc`, `CoordinatorProc` and `AgentProc` (a trainer or generator rank of
`agent_procs`, with its control API). `proc_cluster.ProcCluster` puts them together.

Every process runs in its own session and logs to `<name>.<start>.log` under the working
directory; `Proc.stop` (SIGTERM, then SIGKILL of the whole session) leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from refitplane.errors import Unavailable
from refitplane.testing.child_processes import free_port, read_ports, reap_group
from refitplane.testing.cluster.agent_procs import process_resources

T = TypeVar("T")

REDIS_SERVER = "/usr/bin/redis-server"
# Agents import torch (about 2 s each on a quiet machine; several start at once).
AGENT_START_TIMEOUT_S = 120.0


def wait_for(what: str, predicate: Callable[[], T | None], timeout_s: float) -> T:
    """Poll `predicate` until it returns something truthy (returned); Unavailable naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Unavailable(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without REFIT_* (each child gets exactly what it is given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env | dict(extra or {})


class Proc:
    """One child process that can be started again with the same arguments."""

    def __init__(
        self, name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_dir = log_dir
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        if self.alive():
            raise Unavailable(f"{self.name} is already running")
        self.starts += 1
        log_path = self.log_dir / f"{self.name}.{self.starts}.log"
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.log_dir,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise Unavailable(f"{self.name} was never started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """Everything every start of this process wrote."""
        paths = sorted(self.log_dir.glob(f"{self.name}.*.log"))
        return "\n".join(p.read_text(errors="replace") for p in paths)

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP: the process stops dead (a long GC pause, a partition, a hung host)."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing cleaned up."""
        if self.proc is not None and self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM (after SIGCONT: a frozen process cannot handle it); `stop` waits."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL whatever is left of its session."""
        if self.proc is None:
            return None
        if self.alive():
            self.terminate()
        reap_group(self.proc, timeout_s)
        return self.proc.returncode

    def resources(self) -> dict[str, int]:
        return process_resources(self.pid)


class RedisProc(Proc):
    """redis-server on loopback with AOF (fsync always); optionally a password, and TLS
    only (`tls=(cert, key)`, the cert also being the CA; clients need no certificate)."""

    def __init__(
        self, workdir: Path, *, password: str = "", tls: tuple[Path, Path] | None = None
    ) -> None:
        self.port = free_port()
        self.password = password
        self.tls = tls
        data = workdir / "redis-data"
        data.mkdir(parents=True, exist_ok=True)
        if tls is None:
            ports = ["--port", str(self.port)]
        else:
            cert, key = tls
            ports = [
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
            ]  # fmt: skip
        argv = [
            REDIS_SERVER, *ports, "--bind", "127.0.0.1", "--dir", str(data),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--protected-mode", "no", "--loglevel", "warning",
            *(["--requirepass", password] if password else []),
        ]  # fmt: skip
        super().__init__("redis", argv, workdir, child_env())

    @property
    def url(self) -> str:
        if self.tls is None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"

    def start(self) -> None:
        self.spawn()
        wait_for("redis-server to answer PING", self._pings, 15.0)

    def _pings(self) -> bool:
        if not self.alive():
            raise Unavailable(f"redis-server exited:\n{self.log()[-2000:]}")
        auth = f"AUTH {self.password}\r\n" if self.password else ""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                sock = raw
                if self.tls is not None:
                    context = ssl.create_default_context(cafile=str(self.tls[0]))
                    sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
                sock.sendall(f"{auth}PING\r\n".encode())
                return b"+PONG" in sock.recv(64)
        except OSError:
            return False


class CoordinatorProc(Proc):
    """The coordinator process; fixed ports, so a restart keeps its address."""

    def __init__(self, workdir: Path, env: Mapping[str, str]) -> None:
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.probe_port = free_port()
        self.lane_port = free_port()
        self.port_file = workdir / "coordinator-ports.json"
        argv = [
            sys.executable, "-m", "refitplane.coordinator",
            "--grpc-host", "127.0.0.1", "--http-host", "127.0.0.1",
            "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
            "--probe-port", str(self.probe_port), "--lane-port", str(self.lane_port),
            "--port-file", str(self.port_file), "--env-file", str(workdir / "no.env"),
        ]  # fmt: skip
        super().__init__("coordinator", argv, workdir, child_env(env))
        self.tls = "REFIT_TLS_CERT_FILE" in env

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    @property
    def probe_url(self) -> str:
        """/healthz and /readyz on their own thread (plain HTTP, TLS or not)."""
        return f"http://127.0.0.1:{self.probe_port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.port_file.unlink(missing_ok=True)
        self.spawn()

        def serving() -> bool:
            if not self.alive():
                raise Unavailable(f"the coordinator exited:\n{self.log()[-3000:]}")
            return read_ports(self.port_file) is not None

        wait_for("the coordinator to serve", serving, timeout_s)


class AgentProc(Proc):
    """A trainer or generator rank (`agent_procs`) and its control API."""

    def __init__(
        self,
        name: str,
        role: str,
        args: Sequence[str],
        workdir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.role = role
        self.control_file = workdir / f"{name}.control.json"
        argv = [
            sys.executable, "-m", "refitplane.testing.cluster.agent_procs", role,
            "--control-file", str(self.control_file), *args,
        ]  # fmt: skip
        super().__init__(name, argv, workdir, child_env(env))
        self._port = 0

    def spawn(self) -> None:
        self.control_file.unlink(missing_ok=True)
        self._port = 0
        super().spawn()

    def wait_started(self, timeout_s: float = AGENT_START_TIMEOUT_S) -> None:
        def started() -> int:
            if not self.alive():
                raise Unavailable(f"agent {self.name} exited:\n{self.log()[-3000:]}")
            try:
                return int(json.loads(self.control_file.read_text())["port"])
            except (OSError, ValueError, KeyError):
                return 0

        self._port = wait_for(f"agent {self.name} to start", started, timeout_s)

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> httpx.Response:
        if not self._port:
            raise Unavailable(f"agent {self.name} is not started")
        return httpx.request(
            method, f"http://127.0.0.1:{self._port}{path}", json=body, timeout=timeout_s + 5
        )

    def status(self) -> dict[str, Any]:
        response = self.call("GET", "/status")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def arm(self, **faults: Any) -> dict[str, Any]:
        response = self.call("POST", "/faults", faults)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def release(self) -> dict[str, Any]:
        """Let the transfer held by `arm(hold=True)` go on."""
        response = self.call("POST", "/faults/release", {})
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def step(self, version: int, timeout_s: float = 30.0, hold_s: float = 0.0) -> httpx.Response:
        body = {"version": version, "timeout_s": timeout_s, "hold_s": hold_s}
        return self.call("POST", "/step", body, timeout_s + hold_s)

    def serve(self, timeout_s: float = 10.0) -> httpx.Response:
        return self.call("POST", "/serve", {"timeout_s": timeout_s}, timeout_s)

    def outcome(self, refit_id: str) -> dict[str, Any] | None:
        """This rank's recorded end of `refit_id`'s transfer (None: not ended yet)."""
        for o in self.status()["outcomes"]:
            if o["refit_id"] == refit_id:
                return dict(o)
        return None
