"""A refit deployment made of real processes, for reliability tests and the soak benchmark:
`redis-server`, the coordinator (`python -m refitplane.coordinator`) and trainer / generator
ranks (`python -m refitplane.testing.cluster.agent_procs`), each of which a test may kill (SIGKILL),
freeze (SIGSTOP), restart or stop.

    with ProcCluster(workdir, coordinator_env={"REFIT_TRANSFER_TIMEOUT_S": "8"}) as cluster:
        cluster.add_trainers(2)
        cluster.add_replica("rep-0", tp=2)
        cluster.wait_ready()
        final = cluster.refit(1)          # trainers step to version 1, trigger, wait

Every process runs in its own session and is always stopped (SIGTERM, then SIGKILL) when the
cluster closes; ports are chosen once, so a restarted coordinator or Redis comes back at the
same address and the agents reconnect by themselves.
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
from types import TracebackType
from typing import Any, TypeVar

import httpx

from refitplane.client import RefitClient
from refitplane.demo.processes import free_port, read_ports, reap_group
from refitplane.errors import Unavailable
from refitplane.protocol import RefitState
from refitplane.protocol.models import Refit, Topology
from refitplane.testing.cluster.agent_procs import process_resources

T = TypeVar("T")

REDIS_SERVER = "/usr/bin/redis-server"
# Agents import torch (about 2 s each on a quiet machine; several start at once).
AGENT_START_TIMEOUT_S = 120.0
JOB = "rel-job"

# Short timeouts keep failure tests fast; a test overrides what it exercises.
FAST_COORDINATOR_ENV: dict[str, str] = {
    "REFIT_LEASE_TTL_S": "3",
    "REFIT_PREPARE_TIMEOUT_S": "10",
    "REFIT_TRANSFER_TIMEOUT_S": "10",
    "REFIT_GROUP_TIMEOUT_S": "10",
    "REFIT_VERIFY_TIMEOUT_S": "10",
    # Small buckets: a refit of the synthetic model is many messages in several groups, so
    # a fault can land between them.
    "REFIT_BUCKET_BYTES": str(16 * 1024),
    "REFIT_MAX_INFLIGHT_BYTES": str(256 * 1024),
    "REFIT_LOG_LEVEL": "INFO",
}


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
        self.port_file = workdir / "coordinator-ports.json"
        argv = [
            sys.executable, "-m", "refitplane.coordinator",
            "--grpc-host", "127.0.0.1", "--http-host", "127.0.0.1",
            "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
            "--probe-port", str(self.probe_port),
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


class ProcCluster:
    """Redis + coordinator + agent processes of one job, all under `workdir`."""

    def __init__(
        self,
        workdir: Path,
        *,
        coordinator_env: Mapping[str, str] | None = None,
        job: str = JOB,
        redis: bool = True,
        redis_password: str = "",
        token: str = "",
        scale: int = 1,
        agent_log_level: str = "WARNING",
    ) -> None:
        self.workdir = workdir
        self.agent_log_level = agent_log_level
        self.job = job
        self.scale = scale
        self.token = token
        self.redis: RedisProc | None = (
            RedisProc(workdir, password=redis_password) if redis else None
        )
        env = dict(FAST_COORDINATOR_ENV)
        if self.redis is not None:
            env["REFIT_REDIS_URL"] = self.redis.url
            if redis_password:
                env["REFIT_REDIS_PASSWORD"] = redis_password
        self.token_file: Path | None = None
        if token:
            self.token_file = workdir / "token"
            self.token_file.write_text(token)
            env["REFIT_AUTH_TOKEN_FILE"] = str(self.token_file)
        env.update(coordinator_env or {})
        self.coordinator = CoordinatorProc(workdir, env)
        self.tls_ca = env.get("REFIT_TLS_CERT_FILE", "")
        self.agents: dict[str, AgentProc] = {}
        self.trainer_world = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> ProcCluster:
        if self.redis is not None:
            self.redis.start()
        self.coordinator.start()
        return self

    def close(self) -> None:
        for agent in self.agents.values():
            agent.terminate()  # all at once: each takes about a second to deregister
        for agent in self.agents.values():
            agent.stop(timeout_s=10)
        self.coordinator.stop()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> ProcCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- agents ---------------------------------------------------------------------------------

    def _agent_args(self, rank: int, world: int, version: int) -> list[str]:
        args = [
            "--coordinator", self.coordinator.grpc_target, "--job", self.job,
            "--rank", str(rank), "--world", str(world), "--version", str(version),
            "--scale", str(self.scale), "--log-level", self.agent_log_level,
        ]  # fmt: skip
        if self.token_file is not None:
            args += ["--token-file", str(self.token_file)]
        if self.tls_ca:
            args += ["--tls-ca", self.tls_ca]
        return args

    def add_trainers(
        self, world: int, *, version: int = 0, checkpoint: str | Path = ""
    ) -> list[AgentProc]:
        """`world` trainer ranks holding `synthetic_state(version)`, or their share of a
        Hugging Face checkpoint directory."""
        self.trainer_world = world
        out = []
        extra = ["--checkpoint", str(checkpoint)] if checkpoint else []
        for rank in range(world):
            args = [*self._agent_args(rank, world, version), *extra]
            agent = AgentProc(f"trainer-{rank}", "trainer", args, self.workdir)
            self.agents[agent.name] = agent
            agent.spawn()
            out.append(agent)
        return out

    def add_replica(self, replica: str, tp: int = 1, *, version: int = 0) -> list[AgentProc]:
        out = []
        for rank in range(tp):
            agent = AgentProc(
                f"{replica}-{rank}",
                "generator",
                [*self._agent_args(rank, tp, version), "--replica", replica],
                self.workdir,
            )
            self.agents[agent.name] = agent
            agent.spawn()
            out.append(agent)
        return out

    @property
    def trainers(self) -> list[AgentProc]:
        return [a for a in self.agents.values() if a.role == "trainer"]

    @property
    def generators(self) -> list[AgentProc]:
        return [a for a in self.agents.values() if a.role == "generator"]

    def restart_agent(
        self, name: str, *, version: int | None = None, checkpoint: str | Path | None = None
    ) -> AgentProc:
        """Start a (killed) agent again, holding `version` (trainers: the current step) or
        another checkpoint."""
        agent = self.agents[name]
        agent.stop(timeout_s=5)
        for flag, value in (("--version", version), ("--checkpoint", checkpoint)):
            if value is not None:
                i = agent.argv.index(flag)
                agent.argv[i + 1] = str(value)
        agent.spawn()
        agent.wait_started()
        return agent

    def wait_ready(self, timeout_s: float = AGENT_START_TIMEOUT_S) -> None:
        """Every agent started, and every live member has published its layout."""
        for agent in self.agents.values():
            if agent.alive():
                agent.wait_started(timeout_s)
        expected = {a.status()["member_id"] for a in self.agents.values() if a.alive()}

        def published() -> bool:
            topo = self.topology()
            ready = {m.member_id for m in topo.members if m.layout_digest}
            return expected <= ready

        wait_for("every member to publish its layout", published, timeout_s)

    # -- refits ---------------------------------------------------------------------------------

    def client(self, timeout_s: float = 10.0) -> RefitClient:
        return RefitClient(
            self.coordinator.grpc_target,
            token=self.token or None,
            tls_ca=self.tls_ca or None,
            timeout_s=timeout_s,
        )

    def topology(self) -> Topology:
        with self.client() as client:
            return client.topology(self.job)

    def step_trainers(self, version: int, timeout_s: float = 30.0) -> None:
        for agent in self.trainers:
            response = agent.step(version, timeout_s)
            if response.status_code != 200:
                raise Unavailable(f"{agent.name} could not step to {version}: {response.text}")

    def trigger(self, version: int, **kwargs: Any) -> Refit:
        with self.client() as client:
            return client.trigger(self.job, version=version, **kwargs)

    def wait(self, refit_id: str, timeout_s: float = 60.0) -> Refit:
        with self.client() as client:
            return client.wait(refit_id, timeout_s=timeout_s)

    def refit(self, version: int, timeout_s: float = 60.0) -> Refit:
        """A training step to `version` on every trainer, then a refit to it, to the end."""
        self.step_trainers(version)
        return self.wait(self.trigger(version).refit_id, timeout_s)

    def wait_state(self, refit_id: str, state: RefitState, timeout_s: float = 30.0) -> Refit:
        def reached() -> Refit | None:
            with self.client() as client:
                record = client.get(refit_id)
            if record.state.terminal and record.state is not state:
                raise Unavailable(f"refit ended {record.state.value} ({record.message})")
            return record if record.state is state else None

        return wait_for(f"refit {refit_id} to be {state.value}", reached, timeout_s)

    def wait_outcome(self, agent: AgentProc, refit_id: str, timeout_s: float = 30.0) -> Any:
        """Wait until `agent`'s data plane ended `refit_id` (its transfer returned)."""
        return wait_for(
            f"{agent.name} to end refit {refit_id}", lambda: agent.outcome(refit_id), timeout_s
        )
