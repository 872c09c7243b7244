"""Request metrics and the access log, shared by the gRPC interceptor and the REST middleware.

Metrics (on the coordinator's registry, so /metrics serves them with the refit metrics):

    refit_grpc_requests_total{service, method, code}         every call, by status code
    refit_grpc_request_duration_seconds{service, method}     unary calls (streams live long)
    refit_http_requests_total{method, route, status}         every request, by route template
    refit_http_request_duration_seconds{method, route}
    refit_build_info{version, python, grpc, store}           always 1

Labels are bounded: gRPC methods and REST route templates (`/v1/jobs/{job}/refits`, never
the job name; an unknown path is `unmatched`). The access log writes one line per request:
INFO for the orchestrator API and REST calls and for every failure, DEBUG for what runs all
the time when it succeeds (agents' lease renewals and reports, health checks, scrapes), so
INFO stays readable at hundreds of members. With REFIT_LOG_JSON the fields are JSON keys.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from refitplane.version import __version__

access_log = logging.getLogger("refitplane.coordinator.access")

# Request latency: sub-millisecond reads to multi-second triggers under a slow store.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Calls that succeed all the time (per member, per probe): logged at DEBUG when they succeed.
_ROUTINE_GRPC_SERVICES = frozenset({"refit.v1.AgentService", "grpc.health.v1.Health"})
_ROUTINE_HTTP_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass(frozen=True)
class AccessRecord:
    """One finished request, as the access log and JSON logs carry it."""

    transport: str  # "grpc" | "http"
    method: str  # gRPC: /package.Service/Method; HTTP: GET, POST
    target: str  # gRPC: the method again; HTTP: the path as requested
    status: str  # gRPC: OK, NOT_FOUND, ...; HTTP: 200, 404, ...
    duration_s: float
    peer: str


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry, *, store: str) -> None:
        self.grpc_requests, self.grpc_seconds = _calls_and_latency(
            registry, "grpc", "gRPC calls", ["service", "method"], "code"
        )
        self.http_requests, self.http_seconds = _calls_and_latency(
            registry, "http", "REST requests", ["method", "route"], "status"
        )
        build = Gauge(
            "refit_build_info",
            "The coordinator's release and runtime (always 1)",
            ["version", "python", "grpc", "store"],
            registry=registry,
        )
        build.labels(__version__, platform.python_version(), grpc.__version__, store).set(1)

    def grpc_call(
        self, full_method: str, code: grpc.StatusCode, duration_s: float, *, unary: bool, peer: str
    ) -> None:
        service, _, method = full_method.lstrip("/").partition("/")
        self.grpc_requests.labels(service, method, code.name).inc()
        if unary:
            self.grpc_seconds.labels(service, method).observe(duration_s)
        routine = service in _ROUTINE_GRPC_SERVICES and code is grpc.StatusCode.OK
        _log(AccessRecord("grpc", full_method, full_method, code.name, duration_s, peer), routine)

    def http_request(
        self, method: str, route: str, path: str, status: int, duration_s: float, *, peer: str
    ) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_seconds.labels(method, route).observe(duration_s)
        routine = route in _ROUTINE_HTTP_ROUTES and status < 400
        _log(AccessRecord("http", method, path, str(status), duration_s, peer), routine)


def _calls_and_latency(
    registry: CollectorRegistry, transport: str, what: str, labels: list[str], outcome: str
) -> tuple[Counter, Histogram]:
    """`refit_<transport>_requests_total{*labels, outcome}` and its latency histogram."""
    calls = Counter(
        f"refit_{transport}_requests",
        f"{what} handled, by {', '.join(labels)} and {outcome}",
        [*labels, outcome],
        registry=registry,
    )
    latency = Histogram(
        f"refit_{transport}_request_duration_seconds",
        f"Time to answer {what} (gRPC: unary calls only; a stream lives long)",
        labels,
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    return calls, latency


def _log(record: AccessRecord, routine: bool) -> None:
    level = logging.DEBUG if routine else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    access_log.log(
        level,
        "%s %s %s %s %.1f ms %s",
        record.transport,
        record.method,
        record.target if record.transport == "http" else "-",
        record.status,
        1e3 * record.duration_s,
        record.peer or "-",
        extra={"access": record},
    )
