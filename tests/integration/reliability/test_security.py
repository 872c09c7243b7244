"""Security, with every part a real process: a coordinator serving gRPC and HTTPS (TLS) with
a bearer token from a mounted file, REFIT_ALLOWED_JOBS and a trigger rate limit, on a Redis
that requires a password (and, in one test, on a Redis that only speaks TLS); a trainer and
a generator rank that present the token and verify the coordinator's certificate.

Expected: a refit commits through all of it; every mutating gRPC method and every mutating
REST route refuses a missing or wrong token (the lists come from the service descriptors and
the OpenAPI schema, so a new endpoint is covered without editing this file), reads are open;
plaintext is refused; jobs not configured are NOT_FOUND; triggers beyond the rate answer
RESOURCE_EXHAUSTED / 429; a wrong Redis password stops the coordinator at start with a
message that names the problem; the token and the Redis password appear in no log line and
no error message.
"""

from __future__ import annotations

import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from refitplane._generated.refit.v1 import agent_pb2, orchestrator_pb2
from refitplane.errors import RateLimited
from refitplane.testing.cluster.proc_cluster import ProcCluster
from refitplane.testing.cluster.processes import CoordinatorProc, RedisProc, wait_for
from tests.integration.coordinator.test_process import _self_signed
from tests.integration.reliability.conftest import FAULT_ENV
from tests.integration.reliability.support import World

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "tok-7f3a91c2e5d84b60a1f2c3d4e5f60718"
REDIS_PASSWORD = "redis-pw-0c1d2e3f4a5b6c7d8e9f"
OPEN_GRPC = {"GetRefit", "ListRefits", "WatchRefit", "GetTopology"}
# Everything the server said back in this module (error details, bodies), checked for secrets.
SEEN: list[str] = []


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, certs: tuple[Path, Path]) -> Iterator[World]:
    cert, key = certs
    env = {
        **FAULT_ENV,
        "REFIT_TLS_CERT_FILE": str(cert),
        "REFIT_TLS_KEY_FILE": str(key),
        "REFIT_ALLOWED_JOBS": "rel-job,spare-job",
        "REFIT_TRIGGER_RATE_PER_S": "1",
        "REFIT_LOG_LEVEL": "DEBUG",  # the most verbose logs must not leak secrets either
    }
    cluster = ProcCluster(
        tmp_path_factory.mktemp("security"),
        coordinator_env=env,
        token=TOKEN,
        redis_password=REDIS_PASSWORD,
        agent_log_level="DEBUG",
    )
    try:
        cluster.start()
        cluster.add_trainers(1)
        cluster.add_replica("rep-0", 1)
        cluster.wait_ready()
        w = World(cluster)
        w.commit()  # TLS + token + Redis password, end to end
        yield w
    finally:
        cluster.close()


def _channel(world: World, certs: tuple[Path, Path]) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=certs[0].read_bytes())
    return grpc.secure_channel(world.cluster.coordinator.grpc_target, creds)


def _https(world: World, certs: tuple[Path, Path]) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(certs[0]))
    return httpx.Client(base_url=world.cluster.coordinator.http_url, verify=context, timeout=10)


def _methods() -> list[tuple[str, str, Any, bool]]:
    """(service, method, request class, server streaming) of every refit.v1 RPC."""
    out = []
    for module in (agent_pb2, orchestrator_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                request = getattr(module, method.input_type.name, None)
                if request is None:  # defined in common.proto
                    from refitplane._generated.refit.v1 import common_pb2

                    request = getattr(common_pb2, method.input_type.name)
                out.append((service.full_name, method.name, request, method.server_streaming))
    return out


def _code(
    channel: grpc.Channel, service: str, method: str, request: Any, stream: bool, md: Any
) -> grpc.StatusCode:
    """Call `method` with an empty request and `md` metadata; the status it ends with."""
    path = f"/{service}/{method}"
    kw = {"request_serializer": request.SerializeToString, "response_deserializer": bytes}
    try:
        if stream:
            list(channel.unary_stream(path, **kw)(request(), metadata=md, timeout=3))
        else:
            channel.unary_unary(path, **kw)(request(), metadata=md, timeout=5)
    except grpc.RpcError as exc:
        SEEN.append(exc.details() or "")
        return exc.code()
    return grpc.StatusCode.OK


def test_every_mutating_grpc_call_needs_the_token(world: World, certs) -> None:
    methods = _methods()
    assert len(methods) >= 10, methods
    wrong = [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]
    good = (("authorization", f"Bearer {TOKEN}"),)
    with _channel(world, certs) as channel:
        for service, method, request, stream in methods:
            for md in wrong:
                code = _code(channel, service, method, request, stream, md)
                if method in OPEN_GRPC:
                    assert code != grpc.StatusCode.UNAUTHENTICATED, (method, md)
                else:
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, md, code)
            # With the token the same empty request gets past auth (to its own checks).
            code = _code(channel, service, method, request, stream, good)
            assert code != grpc.StatusCode.UNAUTHENTICATED, method


def test_every_mutating_rest_route_needs_the_token(world: World, certs) -> None:
    with _https(world, certs) as http:
        schema = http.get("/openapi.json").json()
        routes = [
            (verb.upper(), path)
            for path, ops in schema["paths"].items()
            for verb in ops
            if verb in {"get", "post", "put", "patch", "delete"}
        ]
        mutating = [(v, p) for v, p in routes if v != "GET"]
        assert mutating, routes
        for verb, path in routes:
            url = path.replace("{job}", "rel-job").replace("{refit_id}", "0" * 32)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                response = http.request(verb, url, headers=headers)
                SEEN.append(response.text)
                if verb == "GET":
                    assert response.status_code != 401, (verb, path)
                else:
                    assert response.status_code == 401, (verb, path, headers)
                    assert response.headers["www-authenticate"] == "Bearer"
            if verb != "GET":
                ok = http.request(verb, url, headers={"Authorization": f"Bearer {TOKEN}"})
                SEEN.append(ok.text)
                assert ok.status_code != 401, (verb, path)


def test_plaintext_is_refused(world: World) -> None:
    coordinator = world.cluster.coordinator
    with grpc.insecure_channel(coordinator.grpc_target) as channel:
        stub = channel.unary_unary(
            "/refit.v1.RefitService/GetTopology",
            request_serializer=orchestrator_pb2.GetTopologyRequest.SerializeToString,
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.RpcError) as err:
            stub(orchestrator_pb2.GetTopologyRequest(job="rel-job"), timeout=3)
        assert err.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{coordinator.http_port}/healthz", timeout=3)


def test_jobs_not_configured_are_rejected(world: World, certs) -> None:
    with _channel(world, certs) as channel:
        stub = channel.unary_unary(
            "/refit.v1.AgentService/Register",
            request_serializer=agent_pb2.RegisterRequest.SerializeToString,
            response_deserializer=bytes,
        )
        request = agent_pb2.RegisterRequest(job="other-job", role=1, world_size=1, device="cpu")
        with pytest.raises(grpc.RpcError) as err:
            stub(request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "REFIT_ALLOWED_JOBS" in (err.value.details() or "")
    with _https(world, certs) as http:
        response = http.post(
            "/v1/jobs/other-job/refits", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert response.status_code == 404
        SEEN.append(response.text)


def test_trigger_rate_limit(world: World, certs) -> None:
    limited = 0
    for _ in range(4):
        try:
            world.cluster.trigger(0, idempotency_key="")
        except RateLimited as exc:
            limited += 1
            SEEN.append(exc.message)
    assert limited >= 2, "4 triggers in a burst at 1/s: at most 2 may pass"
    with _https(world, certs) as http:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        codes = [
            http.post("/v1/jobs/rel-job/refits", headers=headers).status_code for _ in range(3)
        ]
        assert 429 in codes, codes
    with world.cluster.client() as client:
        for refit in client.list("rel-job", limit=20):
            if not refit.state.terminal:
                client.wait(refit.refit_id, timeout_s=60)
        world.version = max(r.version for r in client.list("rel-job", limit=20))
    time.sleep(2.0)  # the bucket refills (1 per second, burst 1)
    world.commit()


def test_wrong_redis_password_stops_the_coordinator_at_start(world: World, tmp_path: Path) -> None:
    redis = world.cluster.redis
    assert redis is not None
    wrong = "not-the-" + REDIS_PASSWORD
    coordinator = CoordinatorProc(
        tmp_path,
        {**FAULT_ENV, "REFIT_REDIS_URL": redis.url, "REFIT_REDIS_PASSWORD": wrong},
    )
    coordinator.spawn()
    try:
        assert coordinator.proc is not None
        code = coordinator.proc.wait(timeout=60)
    finally:
        coordinator.stop()
    assert code != 0
    log = coordinator.log()
    assert "AuthenticationError" in log or "unreachable" in log, log[-2000:]
    assert wrong not in log
    assert REDIS_PASSWORD not in log


def test_redis_over_tls(tmp_path: Path, certs: tuple[Path, Path]) -> None:
    redis = RedisProc(tmp_path, password=REDIS_PASSWORD, tls=certs)
    redis.start()
    coordinator = CoordinatorProc(
        tmp_path,
        {**FAULT_ENV, "REFIT_REDIS_URL": redis.url, "REFIT_REDIS_PASSWORD": REDIS_PASSWORD},
    )
    try:
        coordinator.start()
        with httpx.Client(base_url=coordinator.http_url, timeout=5) as http:
            wait_for("/readyz over a TLS Redis", lambda: http.get("/readyz").status_code == 200, 20)
            assert http.get("/v1/jobs/nobody/topology").status_code == 404
        log = coordinator.log()
        assert REDIS_PASSWORD not in log
        assert "store rediss://***@127.0.0.1" in log
    finally:
        coordinator.stop()
        redis.stop()


def test_no_secrets_in_logs_or_errors(world: World) -> None:
    """Runs last: everything the module made the processes log or answer."""
    assert SEEN, "the tests above collected nothing"
    for text in SEEN:
        assert TOKEN not in text
        assert REDIS_PASSWORD not in text
    processes = [world.cluster.coordinator, *world.cluster.agents.values()]
    for proc in processes:
        log = proc.log()
        assert log, proc.name
        assert TOKEN not in log, proc.name
        assert REDIS_PASSWORD not in log, proc.name
    assert "auth on, TLS on" in world.cluster.coordinator.log()
    print(f"checked {len(SEEN)} answers and {len(processes)} process logs", file=sys.stderr)
