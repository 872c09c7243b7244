"""Shared fixtures for integration tests: a real redis-server and real coordinators.

Fixtures (all clean up after themselves: no processes, ports or temp dirs left behind):

* ``redis_server`` (session) — one ``redis-server`` on a free loopback port, no persistence.
  ``redis_url`` (function) flushes it and returns its URL, so each test starts empty.
* ``redis_factory`` (function) — ``redis_factory(appendonly=True)`` starts a dedicated
  server (its own dir) that a test may ``restart()`` to prove what survives.
* ``store_url`` (function, parametrized ``embedded`` / ``redis``) — "" or a fresh Redis URL;
  a test taking it runs once per store.
* ``coordinator_factory`` (function) — ``coordinator_factory(redis_url="", **settings)``
  starts an in-process coordinator (gRPC + REST on port 0, its own event loop in a thread)
  and returns a ``RunningCoordinator`` (``.grpc_target``, ``.http_url``, ``.core``,
  ``.call(coro)``, ``.stop(graceful=...)``). Settings default to short timeouts.
* ``coordinator`` (function) — one coordinator on the embedded store.
* ``coordinator_process`` (function) — ``coordinator_process(*args, env=...)`` runs the
  coordinator as a real process (``python -m refitplane.coordinator``) on port 0 and returns
  a ``CoordinatorProcess`` (``.grpc_target``, ``.http_url``, ``.terminate()``, ``.kill()``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from refitplane.testing.child_processes import free_port
from refitplane.testing.coordinator import TEST_SETTINGS, RunningCoordinator

# `refit-coordinator`'s module, run by the interpreter under test.
COORDINATOR_MODULE = ("-m", "refitplane.coordinator")

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll `predicate` every 10 ms; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what or predicate}")
        time.sleep(0.01)


# --- Redis ---------------------------------------------------------------------------------


class RedisServer:
    """One redis-server process on loopback, in its own directory."""

    def __init__(self, workdir: Path, *, appendonly: bool = False) -> None:
        self.dir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read()!r}")  # type: ignore[union-attr]
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer PING within 10 s")
            time.sleep(0.02)

    def command(self, *parts: str) -> bytes:
        """One raw RESP command (enough for FLUSHALL/INFO without a client library)."""
        payload = f"*{len(parts)}\r\n" + "".join(f"${len(p)}\r\n{p}\r\n" for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(payload.encode())
            return s.recv(65536)

    def flush(self) -> None:
        self.command("FLUSHALL")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="refit-redis-") as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def start(*, appendonly: bool = False) -> RedisServer:
        workdir = tmp_path / f"redis-{len(servers)}"
        workdir.mkdir()
        server = RedisServer(workdir, appendonly=appendonly)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(params=["embedded", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded":
        return ""
    server: RedisServer = request.getfixturevalue("redis_server")
    server.flush()
    return server.url


# --- coordinators --------------------------------------------------------------------------


@pytest.fixture
def coordinator_factory() -> Iterator[Callable[..., RunningCoordinator]]:
    from refitplane.coordinator.settings import Settings

    running: list[RunningCoordinator] = []

    def start(redis_url: str = "", **overrides: Any) -> RunningCoordinator:
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            **{**TEST_SETTINGS, "redis_url": redis_url, **overrides},
        )
        c = RunningCoordinator(settings).start()
        running.append(c)
        return c

    yield start
    for c in running:
        with contextlib.suppress(Exception):
            c.stop()


@pytest.fixture
def coordinator(coordinator_factory: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    return coordinator_factory()


@dataclass
class CoordinatorProcess:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log_path: Path

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait: the exit code of a graceful stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def coordinator_process(tmp_path: Path) -> Iterator[Callable[..., CoordinatorProcess]]:
    started: list[CoordinatorProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> CoordinatorProcess:
        n = len(started)
        port_file = tmp_path / f"ports-{n}.json"
        log_path = tmp_path / f"coordinator-{n}.log"
        full_env = (
            {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
            | {"REFIT_GRPC_HOST": "127.0.0.1", "REFIT_HTTP_HOST": "127.0.0.1"}
            | (env or {})
        )
        cmd = [
            sys.executable, *COORDINATOR_MODULE,
            "--grpc-port", "0", "--http-port", "0", "--lane-port", "0", "--port-file", str(port_file),
            "--env-file", str(tmp_path / "no.env"), *args,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=tmp_path, env=full_env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"coordinator process did not start:\n{log_path.read_text()}")
            time.sleep(0.02)
        ports = json.loads(port_file.read_text())
        cp = CoordinatorProcess(proc, ports["grpc_port"], ports["http_port"], log_path)
        started.append(cp)
        return cp

    yield start
    for cp in started:
        with contextlib.suppress(Exception):
            cp.kill()


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """Threads for tests that fire concurrent client calls."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        yield pool


# --- simulated members ---------------------------------------------------------------------

WEIGHT = ("model.layers.0.mlp.down_proj.weight", (16, 8), "bfloat16")
BIAS = ("model.norm.weight", (8,), "float32")


def row_layout(
    rank: int, world: int, *, tensors: tuple[tuple[str, tuple[int, ...], str], ...] = (WEIGHT, BIAS)
) -> Any:
    """`rank`'s share of every tensor when dim 0 is split evenly over `world` ranks."""
    from refitplane.reshard.layout import LayoutBuilder, TensorSpec

    builder = LayoutBuilder()
    for name, shape, dtype in tensors:
        step = shape[0] // world
        box = ((rank * step, (rank + 1) * step), *((0, d) for d in shape[1:]))
        builder.add(TensorSpec.create(name, shape, dtype), rank, box)
    return builder.build()


@dataclass
class SimMember:
    session: Any
    agent: Any

    @property
    def member_id(self) -> str:
        return str(self.session.member_id)


@dataclass
class SimCluster:
    """Simulated agents (real AgentSessions, handlers without a data plane) for one job."""

    target: str
    job: str = "job"
    token: str | None = None
    tls_ca: Any = None
    members: list[SimMember] = field(default_factory=list)

    def add(
        self,
        role: Any,
        *,
        rank: int = 0,
        world: int = 1,
        replica: str = "",
        layout: Any = None,
        behaviour: Any = None,
        device: str = "cpu",
        version: int = 0,
        node: str = "",
        device_uuid: str = "",
    ) -> SimMember:
        from refitplane.agent import AgentSession, MemberInfo
        from refitplane.agent.simulated import SimulatedAgent

        agent = SimulatedAgent(role, behaviour)
        info = MemberInfo(
            job=self.job,
            role=role,
            rank=rank,
            world_size=world,
            replica_id=replica,
            host="127.0.0.1",
            device=device,
            version=version,
            node=node,
            device_uuid=device_uuid,
        )
        session = AgentSession(
            self.target, info, agent, token=self.token, tls_ca=self.tls_ca, timeout_s=10
        )
        agent.session = session
        session.start()
        if layout is not None:
            session.publish_layout(layout)
        member = SimMember(session, agent)
        self.members.append(member)
        return member

    def trainers(self, world: int = 2, **kw: Any) -> list[SimMember]:
        from refitplane.protocol import Role

        return [
            self.add(Role.TRAINER, rank=r, world=world, layout=row_layout(r, world), **kw)
            for r in range(world)
        ]

    def replica(
        self, replica: str, world: int = 1, *, sidecar: bool = False, **kw: Any
    ) -> list[SimMember]:
        """A generator replica (`world` ranks, rows split), optionally with its sidecar last."""
        from refitplane.protocol import Role

        out = [
            self.add(
                Role.GENERATOR,
                rank=r,
                world=world,
                replica=replica,
                layout=row_layout(r, world),
                **kw,
            )
            for r in range(world)
        ]
        if sidecar:
            out.append(
                self.add(
                    Role.GENERATOR_SIDECAR,
                    world=world,
                    replica=replica,
                    behaviour=kw.get("behaviour"),
                    device="",
                )
            )
        return out

    def client(self) -> Any:
        from refitplane.client import RefitClient

        return RefitClient(self.target, token=self.token, tls_ca=self.tls_ca)

    def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                m.session.close()
        self.members.clear()


@pytest.fixture
def sim_cluster() -> Iterator[Callable[..., SimCluster]]:
    """`sim_cluster(coordinator, job=..., token=...)` → a SimCluster closed at teardown."""
    clusters: list[SimCluster] = []

    def make(coord: RunningCoordinator | CoordinatorProcess, **kw: Any) -> SimCluster:
        cluster = SimCluster(coord.grpc_target, **kw)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()
