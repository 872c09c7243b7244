"""The chart's `helm test` script against real servers: a gRPC server with the standard
health service and a real HTTP server, plaintext and TLS, each in this process on a free
loopback port; the script runs as its own process, exactly as in the test pod."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.chart_support import CHART_DIR

pytestmark = pytest.mark.integration

SCRIPT = CHART_DIR / "files" / "healthcheck.py"
SERVICE = "refit.v1.RefitService"
OPENAPI = {"openapi": "3.1.0", "paths": {"/v1/jobs/{job}/refits": {}, "/healthz": {}}}
METRICS = b"# HELP refit_refits_total Refits\n# TYPE refit_refits_total counter\n"


@dataclass
class FakeCoordinator:
    """What the coordinator's HTTP server answers, changeable while the script runs."""

    responses: dict[str, tuple[int, bytes]] = field(
        default_factory=lambda: {
            "/healthz": (200, b'{"status": "ok"}'),
            "/readyz": (200, b'{"status": "ready"}'),
            "/metrics": (200, METRICS),
            "/openapi.json": (200, json.dumps(OPENAPI).encode()),
        }
    )
    http_auth: list[str | None] = field(default_factory=list)
    grpc_auth: list[str | None] = field(default_factory=list)


def _handler(state: FakeCoordinator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.http_auth.append(self.headers.get("Authorization"))
            status, body = state.responses.get(self.path, (404, b"not found"))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler


class _RecordAuth(grpc.ServerInterceptor):
    def __init__(self, state: FakeCoordinator) -> None:
        self._state = state

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = dict(handler_call_details.invocation_metadata or ())
        self._state.grpc_auth.append(metadata.get("authorization"))
        return continuation(handler_call_details)


@dataclass
class Servers:
    state: FakeCoordinator
    health: health.HealthServicer
    http_url: str
    grpc_address: str


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate for localhost/127.0.0.1 signed by it, and an unrelated CA."""
    pytest.importorskip("cryptography.x509")
    from tests.support.tls_certs import certificate, new_key, write_certificate, write_key

    directory = tmp_path_factory.mktemp("pki")
    ca_key = new_key()
    ca_cert = certificate(ca_key, "refit test CA", ca=True, localhost=False)
    other_cert = certificate(new_key(), "unrelated CA", ca=True, localhost=False)
    server_key = new_key()
    server_cert = certificate(
        server_key, "localhost", ca=False, localhost=True, issuer=ca_cert, issuer_key=ca_key
    )
    return Pki(
        write_certificate(directory / "ca.crt", ca_cert),
        write_certificate(directory / "tls.crt", server_cert),
        write_key(directory / "tls.key", server_key),
        write_certificate(directory / "other.crt", other_cert),
    )


def _start_servers(pki: Pki | None) -> Iterator[Servers]:
    state = FakeCoordinator()
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[_RecordAuth(state)]
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    if pki is None:
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    else:
        credentials = grpc.ssl_server_credentials([(pki.key.read_bytes(), pki.cert.read_bytes())])
        grpc_port = grpc_server.add_secure_port("127.0.0.1:0", credentials)
    grpc_server.start()

    http_server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    scheme = "http"
    if pki is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.cert, pki.key)
        http_server.socket = context.wrap_socket(http_server.socket, server_side=True)
        scheme = "https"
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Servers(
            state,
            health_servicer,
            f"{scheme}://localhost:{http_server.server_address[1]}",
            f"localhost:{grpc_port}",
        )
    finally:
        http_server.shutdown()
        http_server.server_close()
        thread.join(timeout=5)
        grpc_server.stop(grace=None).wait(timeout=5)


@pytest.fixture
def servers() -> Iterator[Servers]:
    yield from _start_servers(None)


@pytest.fixture
def tls_servers(pki: Pki) -> Iterator[Servers]:
    yield from _start_servers(pki)


def run_check(
    servers: Servers, *extra: str, timeout_s: float = 3.0
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        str(SCRIPT),
        "--http",
        servers.http_url,
        "--grpc",
        servers.grpc_address,
        "--timeout",
        str(timeout_s),
        *extra,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s + 30, check=False
    )


def test_healthy_coordinator_passes(servers: Servers, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    result = run_check(servers, "--token-file", str(token))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "coordinator healthy" in result.stdout
    for check in ("GET /healthz", "GET /readyz", "GET /metrics", "GET /openapi.json"):
        assert f"ok   {check}" in result.stdout
    assert f"ok   grpc health {SERVICE}: SERVING" in result.stdout
    assert "ok   grpc health (server): SERVING" in result.stdout
    # The token travels on both transports (the coordinator may require it anywhere).
    assert set(servers.state.http_auth) == {"Bearer s3cret-token"}
    assert set(servers.state.grpc_auth) == {"Bearer s3cret-token"}


def test_no_token_sends_no_authorization(servers: Servers) -> None:
    assert run_check(servers).returncode == 0
    assert set(servers.state.http_auth) == {None}
    assert set(servers.state.grpc_auth) == {None}


@pytest.mark.parametrize(
    ("path", "response", "reason"),
    [
        ("/readyz", (503, b"store unreachable"), "HTTP 503: store unreachable"),
        ("/healthz", (500, b"boom"), "HTTP 500"),
        ("/metrics", (200, b"hello"), "no Prometheus metrics"),
        ("/openapi.json", (200, b"{}"), "not an OpenAPI document"),
        (
            "/openapi.json",
            (200, b'{"openapi": "3.1.0", "paths": {"/x": {}}}'),
            "the OpenAPI document lists no /v1/ paths",
        ),
    ],
)
def test_unhealthy_http_fails_naming_the_check(
    servers: Servers, path: str, response: tuple[int, bytes], reason: str
) -> None:
    servers.state.responses[path] = response
    result = run_check(servers, timeout_s=1.0)
    assert result.returncode == 1, result.stdout
    assert f"FAIL GET {path}: {reason}" in result.stdout
    assert "coordinator NOT healthy" in result.stdout


def test_not_serving_grpc_service_fails(servers: Servers) -> None:
    servers.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    result = run_check(servers, timeout_s=1.0)
    assert result.returncode == 1
    assert f"FAIL grpc health {SERVICE}: NOT_SERVING" in result.stdout
    assert "ok   grpc health (server): SERVING" in result.stdout


def test_unreachable_grpc_fails_within_the_timeout(servers: Servers) -> None:
    with_dead_grpc = Servers(servers.state, servers.health, servers.http_url, "127.0.0.1:1")
    started = time.monotonic()
    result = run_check(with_dead_grpc, timeout_s=2.0)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert "FAIL grpc health (server): StatusCode.UNAVAILABLE" in result.stdout
    # One retry round may start just before the deadline: bounded by timeout + one round.
    assert elapsed < 2.0 + 2 * 5.0 + 5.0


def test_recovers_when_the_coordinator_becomes_ready(servers: Servers) -> None:
    servers.state.responses["/readyz"] = (503, b"starting")

    def become_ready() -> None:
        time.sleep(1.0)
        servers.state.responses["/readyz"] = (200, b"ready")

    flipper = threading.Thread(target=become_ready)
    flipper.start()
    result = run_check(servers, timeout_s=15.0)
    flipper.join()
    assert result.returncode == 0, result.stdout
    assert len(servers.state.http_auth) > 4, "it retried"


def test_tls_with_the_right_ca(tls_servers: Servers, pki: Pki) -> None:
    result = run_check(tls_servers, "--ca-file", str(pki.ca))
    assert result.returncode == 0, result.stdout + result.stderr


def test_tls_rejects_an_untrusted_certificate(tls_servers: Servers, pki: Pki) -> None:
    result = run_check(tls_servers, "--ca-file", str(pki.other_ca), timeout_s=1.0)
    assert result.returncode == 1
    assert "FAIL GET /healthz: " in result.stdout
    assert "CERTIFICATE_VERIFY_FAILED" in result.stdout
    assert "FAIL grpc health (server): StatusCode.UNAVAILABLE" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--http", "ftp://x", "--grpc", "x:1"], "expected an http:// or https:// URL"),
        (["--http", "http://x", "--grpc", "x:1", "--timeout", "0"], "must be positive"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr
