"""Health check of a running refit coordinator, used by the chart's `helm test` pod.

Checks what operators and agents depend on: REST liveness (`/healthz`), readiness (`/readyz`,
the store answers), Prometheus metrics (`/metrics`), the OpenAPI document, and the gRPC
`grpc.health.v1` status of the server ("") and of `refit.v1.RefitService`. All checks are
retried until they pass together or `--timeout` expires; every wait is bounded.

Runs in the coordinator image: Python, grpcio and grpcio-health-checking, nothing else.
Exit status 0 when healthy, 1 when not (the failures are printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

GRPC_SERVICES = ("", "refit.v1.RefitService")
# Bounds a single request so that one stuck call cannot eat the whole budget.
REQUEST_TIMEOUT_S = 5.0
RETRY_INTERVAL_S = 2.0

# Returns a problem description for a response body, or None when it is fine.
BodyCheck = Callable[[bytes], "str | None"]


@dataclass(frozen=True)
class Target:
    http_url: str
    grpc_address: str
    ca_file: Path | None
    server_name: str | None
    token: str | None

    @property
    def tls(self) -> bool:
        # One switch for both servers: the coordinator serves TLS on gRPC and HTTP or on neither.
        return self.http_url.startswith("https://")


@dataclass(frozen=True)
class Outcome:
    check: str
    ok: bool
    detail: str


def _http_get(target: Target, path: str) -> tuple[int, bytes]:
    url = target.http_url.rstrip("/") + path
    request = urllib.request.Request(url, method="GET")
    if target.token:
        request.add_header("Authorization", f"Bearer {target.token}")
    context = None
    if target.tls:
        context = ssl.create_default_context(cafile=str(target.ca_file) if target.ca_file else None)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=context) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def check_http(target: Target) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for path in ("/healthz", "/readyz"):
        outcomes.append(_expect_status(target, path, lambda _body: None))
    outcomes.append(_expect_status(target, "/metrics", _metrics_problem))
    outcomes.append(_expect_status(target, "/openapi.json", _openapi_problem))
    return outcomes


def _expect_status(target: Target, path: str, body_problem: BodyCheck) -> Outcome:
    name = f"GET {path}"
    try:
        status, body = _http_get(target, path)
    except (OSError, ValueError) as exc:
        return Outcome(name, False, f"{type(exc).__name__}: {exc}")
    if status != 200:
        snippet = body[:200].decode("utf-8", "replace")
        return Outcome(name, False, f"HTTP {status}: {snippet}")
    problem = body_problem(body)
    if problem:
        return Outcome(name, False, problem)
    return Outcome(name, True, "HTTP 200")


def _metrics_problem(body: bytes) -> str | None:
    if b"# TYPE " not in body:
        return "no Prometheus metrics in the body"
    return None


def _openapi_problem(body: bytes) -> str | None:
    try:
        document = json.loads(body)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(document, dict) or "openapi" not in document:
        return "not an OpenAPI document (no 'openapi' field)"
    paths = document.get("paths", {})
    if not any(str(path).startswith("/v1/") for path in paths):
        return "the OpenAPI document lists no /v1/ paths"
    return None


def _channel(target: Target) -> grpc.Channel:
    if not target.tls:
        return grpc.insecure_channel(target.grpc_address)
    root = target.ca_file.read_bytes() if target.ca_file else None
    options: list[tuple[str, str]] = []
    if target.server_name:
        options.append(("grpc.ssl_target_name_override", target.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.secure_channel(target.grpc_address, credentials, options=options)


def check_grpc(target: Target) -> list[Outcome]:
    metadata = (("authorization", f"Bearer {target.token}"),) if target.token else None
    outcomes: list[Outcome] = []
    with _channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in GRPC_SERVICES:
            name = f"grpc health {service or '(server)'}"
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=service),
                    timeout=REQUEST_TIMEOUT_S,
                    metadata=metadata,
                )
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                outcomes.append(Outcome(name, False, f"{code}: {details}"))
                continue
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            outcomes.append(Outcome(name, status == "SERVING", status))
    return outcomes


def run_checks(target: Target) -> list[Outcome]:
    return check_http(target) + check_grpc(target)


def wait_healthy(target: Target, timeout_s: float) -> list[Outcome]:
    """Run every check until all pass or `timeout_s` elapses; return the last outcomes."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcomes = run_checks(target)
        if all(outcome.ok for outcome in outcomes) or time.monotonic() >= deadline:
            return outcomes
        time.sleep(min(RETRY_INTERVAL_S, max(0.0, deadline - time.monotonic())))


def _parse(argv: Sequence[str] | None) -> tuple[Target, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--http", required=True, help="REST base URL, e.g. http://svc:8080")
    parser.add_argument("--grpc", required=True, help="gRPC address host:port")
    parser.add_argument("--ca-file", type=Path, help="CA bundle that signed the server cert")
    parser.add_argument("--server-name", help="gRPC: TLS name to verify if not the address host")
    parser.add_argument("--token-file", type=Path, help="bearer token sent with each call")
    parser.add_argument("--timeout", type=float, default=60.0, help="overall seconds")
    args = parser.parse_args(argv)
    if not args.http.startswith(("http://", "https://")):
        parser.error(f"--http {args.http!r}: expected an http:// or https:// URL")
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout}: must be positive")
    token = args.token_file.read_text().strip() if args.token_file else None
    target = Target(args.http, args.grpc, args.ca_file, args.server_name, token or None)
    return target, float(args.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    target, timeout_s = _parse(argv)
    outcomes = wait_healthy(target, timeout_s)
    for outcome in outcomes:
        print(f"{'ok  ' if outcome.ok else 'FAIL'} {outcome.check}: {outcome.detail}")
    healthy = all(outcome.ok for outcome in outcomes)
    print("coordinator healthy" if healthy else "coordinator NOT healthy")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
