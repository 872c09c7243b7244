"""Probes that stay fast and true (issue 22, section 4): /healthz and /readyz on their own
port and thread (REFIT_PROBE_PORT, coordinator/probes.py), answering from what the event
loop proves.

* Under a burst of 1,000 concurrent REST reads every probe answers 200 (how fast is
  benchmarks/admission.py's job: tests assert no timings);
* liveness is true: a wedged event loop (blocked longer than REFIT_PROBE_LOOP_STALL_S) turns
  /healthz 503 naming the stall, and 200 again once the loop runs;
* a probe connection is bounded as a whole: a slow-loris client is dropped unanswered
  while it still trickles bytes (probes meanwhile answered), a head over 4 KiB is refused;
* readiness is true: Redis down → /readyz 503 (liveness stays 200: restarting the
  coordinator would not bring Redis back); Redis wiped → 503 while the store is re-seeded
  (the incarnation sentinel); 200 again after each.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from refitplane._generated.refit.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from refitplane.protocol import Role
from refitplane.testing.cluster.proc_cluster import ProcCluster
from refitplane.testing.cluster.processes import wait_for
from refitplane.testing.coordinator import start_coordinator
from tests.integration.conftest import row_layout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "tok-probes-5b0e2d7c9a1f4e36"


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _reads_while_probing(cluster: ProcCluster, n: int) -> tuple[Counter[int], list[int]]:
    """`n` concurrent REST reads; meanwhile a thread of its own GETs the probe port's
    /healthz in a loop (the burst's client would starve a probe on its own event loop)."""
    url, probe = cluster.coordinator.http_url, cluster.coordinator.probe_url
    probes: list[int] = []
    done = threading.Event()

    def prober() -> None:
        with httpx.Client(base_url=probe, timeout=30) as http:
            while not done.is_set() or not probes:
                probes.append(http.get("/healthz").status_code)
                time.sleep(0.01)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(
            base_url=url, timeout=120, limits=limits, headers=headers
        ) as http:
            return await asyncio.gather(
                *(http.get("/v1/jobs/hot/refits?limit=50") for _ in range(n))
            )

    thread = threading.Thread(target=prober, daemon=True)
    thread.start()
    try:
        responses = asyncio.run(burst())
    finally:
        done.set()
        thread.join(timeout=60)
    return Counter(r.status_code for r in responses), probes


def _register_silent_member(target: str) -> None:
    """A member that never renews: after a wipe the coordinator stays not ready until it
    registers again or a lease TTL passed (a window every probe check sees)."""
    with grpc.insecure_channel(target) as channel:
        agent_pb2_grpc.AgentServiceStub(channel).Register(
            agent_pb2.RegisterRequest(
                job="hot", role=common_pb2.ROLE_GENERATOR_SIDECAR, replica_id="quiet", world_size=1
            ),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=30,
        )


def test_probes_answer_under_load_and_follow_the_store(tmp_path: Path, sim_cluster) -> None:
    env = {"REFIT_LEASE_TTL_S": "10"}
    with ProcCluster(tmp_path, token=TOKEN, coordinator_env=env) as cluster:
        sims = sim_cluster(cluster.coordinator, job="hot", token=TOKEN)
        sims.add(Role.TRAINER, layout=row_layout(0, 1))
        sims.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
        healthz = f"{cluster.coordinator.probe_url}/healthz"
        readyz = f"{cluster.coordinator.probe_url}/readyz"
        wait_for("probe /readyz 200", lambda: _status(readyz) == 200, 30)

        codes, probes = _reads_while_probing(cluster, 1000)
        assert set(codes) <= {200, 429}, codes
        assert set(probes) == {200}, Counter(probes)

        assert cluster.redis is not None
        cluster.redis.kill()
        wait_for("probe /readyz 503 with Redis down", lambda: _status(readyz) == 503, 60)
        body = httpx.get(readyz, timeout=5).json()
        assert body["status"] == "not ready", body
        assert body["message"], body
        assert _status(healthz) == 200  # the loop runs: a restart would not help
        cluster.redis.start()
        wait_for("probe /readyz 200 with Redis back", lambda: _status(readyz) == 200, 60)

        _register_silent_member(cluster.coordinator.grpc_target)
        with redis.Redis.from_url(cluster.redis.url) as r:
            r.flushall()
        wait_for("probe /readyz 503 on a wiped store", lambda: _status(readyz) == 503, 60)
        assert _status(healthz) == 200
        # Not ready until the store is re-seeded and the members registered again.
        wait_for("probe /readyz 200 once re-seeded", lambda: _status(readyz) == 200, 60)
        assert _status(f"{cluster.coordinator.http_url}/readyz") == 200
    print(f"[reliability] 1000 reads {dict(codes)}; {len(probes)} probes, all 200")


def test_liveness_fails_while_the_event_loop_is_wedged() -> None:
    coordinator = start_coordinator(probe_port=0, probe_loop_stall_s=1.0)
    try:
        healthz = f"http://127.0.0.1:{coordinator.server.probe_port}/healthz"
        wait_for("probe /healthz 200", lambda: _status(healthz) == 200, 30)
        # Block the loop (as a quadratic check on it once did) well past the bound.
        coordinator.loop.call_soon_threadsafe(time.sleep, 6.0)
        wait_for("probe /healthz 503 while the loop is blocked", lambda: _status(healthz) == 503, 5)
        body = httpx.get(healthz, timeout=5).json()
        assert body["status"] == "stalled", body
        assert "event loop" in body["message"], body
        wait_for("probe /healthz 200 once the loop runs", lambda: _status(healthz) == 200, 30)
        not_found = httpx.get(f"http://127.0.0.1:{coordinator.server.probe_port}/x", timeout=5)
        assert not_found.status_code == 404
    finally:
        coordinator.stop()


def _dropped_while_trickling(port: int, max_bytes: int) -> tuple[bool, bytes]:
    """A slow-loris client: a request line, then one header byte every 50 ms, never ending
    the head. (True, b"") once the server closed the connection before `max_bytes` were
    sent; what it answered, if anything, is returned too."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as loris:
        loris.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
        for _ in range(max_bytes):
            try:
                loris.sendall(b"a")
                readable, _, _ = select.select([loris], [], [], 0.05)
                if readable:
                    answer = loris.recv(4096)
                    return not answer, answer
            except OSError:  # reset: dropped with the byte just sent unread
                return True, b""
    return False, b""


def test_a_slow_or_oversized_request_is_bounded() -> None:
    coordinator = start_coordinator(probe_port=0)
    try:
        port = coordinator.server.probe_port
        healthz = f"http://127.0.0.1:{port}/healthz"
        wait_for("probe /healthz 200", lambda: _status(healthz) == 200, 30)
        result: list[tuple[bool, bytes]] = []
        loris = threading.Thread(target=lambda: result.append(_dropped_while_trickling(port, 400)))
        loris.start()
        try:
            # Probes are answered while the slow client holds its connection open.
            assert [_status(healthz) for _ in range(5)] == [200] * 5
        finally:
            loris.join(timeout=60)
        # 400 bytes at 50 ms take 20 s: the server's whole-request deadline ends it first,
        # however steadily the client sends.
        assert result == [(True, b"")], result

        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000 + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as big:
            big.sendall(head)
            answer = b""
            while chunk := big.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 431 "), answer[:200]
        assert b'"too large"' in answer, answer

        head_only = httpx.head(healthz, timeout=5)
        assert (head_only.status_code, head_only.content) == (200, b"")
    finally:
        coordinator.stop()
