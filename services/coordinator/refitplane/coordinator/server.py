"""One coordinator process: the core, the gRPC server and the REST server (uvicorn) on one
asyncio event loop. `CoordinatorServer.start()` binds (port 0 picks a free port) and
returns once both transports accept connections; `stop()` shuts down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.core.admission import Admission
from refitplane.coordinator.core.service import Coordinator
from refitplane.coordinator.grpc.server import GrpcServer
from refitplane.coordinator.lane import LaneServer
from refitplane.coordinator.observability.grpc_observer import RequestObserver
from refitplane.coordinator.observability.http_observer import HttpObserver
from refitplane.coordinator.observability.requests import RequestMetrics
from refitplane.coordinator.probes import LoopHeartbeat, ProbeServer
from refitplane.coordinator.rest.app import create_app
from refitplane.coordinator.rest.limits import RequestGuard
from refitplane.coordinator.settings import Settings
from refitplane.coordinator.store import open_store
from refitplane.errors import Unavailable
from refitplane.lifecycle import StartupError, bind_failure, check_port_free

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process (or test) owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _lane_tls(settings: Settings) -> ssl.SSLContext | None:
    """The control lane speaks TLS with gRPC's certificate whenever gRPC does."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return context


class CoordinatorServer:
    def __init__(self, settings: Settings, *, redis_prefix: str = "refit:") -> None:
        """Construct inside the event loop that will run it (grpc.aio binds to it)."""
        self.settings = settings
        store = open_store(
            settings.redis_dsn(),
            prefix=redis_prefix,
            max_connections=settings.redis_max_connections,
            pool_timeout_s=settings.redis_pool_timeout_s,
            layout_ttl_s=settings.layout_ttl_s,
        )
        self.core = Coordinator(settings, store)
        self._tokens = TokenCheck(settings.token())
        self.requests = RequestMetrics(self.core.metrics.registry, store=store.kind)
        tls = None
        if settings.tls_cert_file is not None and settings.tls_key_file is not None:
            tls = (settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())
        self._lane: LaneServer | None = None
        if settings.lane_port is not None:
            self._lane = LaneServer(self.core, self._tokens, tls=_lane_tls(settings))
        self._grpc = GrpcServer(
            self.core,
            self._tokens,
            tls=tls,
            outer=[RequestObserver(self.requests)],
            lane_port=lambda: self.lane_port,
        )
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.lane_port = 0
        self.probe_port = 0
        self._heartbeat = LoopHeartbeat(self.core.ready)
        # A store check older than this (3 missed checks and the check's own timeout) is
        # no proof of readiness any more.
        self._probes = ProbeServer(
            self._heartbeat,
            stall_s=settings.probe_loop_stall_s,
            stale_s=3 * self._heartbeat.store_check_s + self._heartbeat.store_timeout_s,
        )
        self._serving = False

    async def start(self) -> None:
        """Raises StartupError (one line naming what and where) for a port in use or an
        unreachable store."""
        s = self.settings
        grpc_flag, http_flag = "--grpc-port / REFIT_GRPC_PORT", "--http-port / REFIT_HTTP_PORT"
        check_port_free("gRPC", s.grpc_host, s.grpc_port, grpc_flag)
        check_port_free("HTTP", s.http_host, s.http_port, http_flag)
        lane_flag = "--lane-port / REFIT_LANE_PORT"
        if s.lane_port is not None:
            check_port_free("the control lane", s.grpc_host, s.lane_port, lane_flag)
        if s.probe_port is not None:
            check_port_free("probes", s.http_host, s.probe_port, "--probe-port / REFIT_PROBE_PORT")
        try:
            await self.core.start()
        except Unavailable as exc:
            raise StartupError(
                f"{exc.message} at {s.redacted_redis_url()}; check --redis-url / REFIT_REDIS_URL"
            ) from None
        try:
            self.grpc_port = self._grpc.bind(s.grpc_host, s.grpc_port)
        except (OSError, RuntimeError) as exc:
            raise StartupError(
                f"cannot listen for gRPC on {s.grpc_host}:{s.grpc_port}: {exc}"
            ) from None
        if self._lane is not None and s.lane_port is not None:
            try:
                self.lane_port = await self._lane.start(s.grpc_host, s.lane_port)
            except OSError as exc:
                raise StartupError(
                    bind_failure("the control lane", s.grpc_host, s.lane_port, lane_flag, exc)
                ) from None
        await self._grpc.start()
        try:
            sock = _bind_http(s.http_host, s.http_port)
        except OSError as exc:
            raise StartupError(
                bind_failure("HTTP", s.http_host, s.http_port, http_flag, exc)
            ) from None
        self.http_port = sock.getsockname()[1]
        if s.probe_port is not None:
            probe_flag = "--probe-port / REFIT_PROBE_PORT"
            try:
                self.probe_port = self._probes.bind(s.http_host, s.probe_port)
            except OSError as exc:
                raise StartupError(
                    bind_failure("probes", s.http_host, s.probe_port, probe_flag, exc)
                ) from None
        self.admission = Admission(
            limit=s.rest_max_concurrent, queued=s.rest_max_queued, wait_s=s.rest_queue_timeout_s
        )
        # The observer outermost, so what the guard refuses (401, 413, 429) is counted too.
        app = RequestGuard(
            create_app(self.core, self._tokens),
            tokens=self._tokens,
            max_body_bytes=s.http_max_body_bytes,
            admission=self.admission,
        )
        config = uvicorn.Config(
            HttpObserver(app, self.requests),
            log_config=None,
            access_log=False,
            lifespan="off",
            ssl_certfile=str(s.tls_cert_file) if s.tls_cert_file else None,
            ssl_keyfile=str(s.tls_key_file) if s.tls_key_file else None,
            timeout_graceful_shutdown=int(STOP_GRACE_S),
        )
        self._http = _Uvicorn(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]), name="http")
        for _ in range(500):
            if self._http.started or self._http_task.done():
                break
            await asyncio.sleep(0.01)
        if not self._http.started:
            if self._http_task.done():
                self._http_task.result()
            raise RuntimeError("the HTTP server did not start within 5 s")
        self._heartbeat.start()
        if s.probe_port is not None:
            self._probes.start()
        log.info(
            "coordinator serving: gRPC %s:%d, control lane %s, HTTP %s:%d, probes %s, store %s, "
            "auth %s, TLS %s",
            s.grpc_host,
            self.grpc_port,
            f"{s.grpc_host}:{self.lane_port}" if self._lane is not None else "off",
            s.http_host,
            self.http_port,
            f"{s.http_host}:{self.probe_port}" if s.probe_port is not None else "off",
            s.redacted_redis_url(),
            "on" if self._tokens.enabled else "off",
            "on" if s.tls else "off",
        )
        self._serving = True

    async def stop(self, *, graceful: bool = True) -> None:
        """Graceful: refits in flight fail now and their participants get AbortRefit before
        the transports close. Not graceful (a simulated crash): in-flight refits are left
        for the next coordinator on the same store."""
        self._probes.stop()
        await self._heartbeat.stop()
        await self.core.stop(graceful=graceful)
        if graceful:
            # Let the aborts reach the agents' streams, then end the streams.
            await asyncio.sleep(0.1)
        self.core.outbox.close_all()
        if self._lane is not None:
            await self._lane.stop()
        if self._http is not None:
            self._http.should_exit = True
        await self._grpc.stop(STOP_GRACE_S if graceful else 0)
        if self._http_task is not None:
            done, _ = await asyncio.wait({self._http_task}, timeout=STOP_GRACE_S + 1)
            if not done:
                log.warning("HTTP server did not stop in time")
                self._http_task.cancel()
        await self.core.close()
        if self._serving:
            log.info("coordinator stopped")
        self._serving = False
