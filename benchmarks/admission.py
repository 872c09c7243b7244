"""Overload: concurrent REST triggers and reads against a real coordinator process on a real
Redis (issue 22, section 4). Prints one row per burst: answers by status (429 vs 503), request
latency p50/p99, `/healthz` p99 while the burst runs — on the REST port (answered on the event
loop) and on the probe port (REFIT_PROBE_PORT: its own thread, what the Helm chart probes) —
and the coordinator's RSS.

    python benchmarks/admission.py                       # bursts of 150 and 500 triggers, 1000 reads
    python benchmarks/admission.py --triggers 150 --reads 0

A job with one simulated trainer and one generator replica (real AgentSessions) is
registered first, so every trigger is a valid one (they coalesce into one pending refit).
The coordinator runs with its defaults (REFIT_REST_MAX_CONCURRENT=32, REFIT_REST_MAX_QUEUED
=512 per lane, a blocking Redis pool of 128).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from refitplane.agent import AgentSession, MemberInfo
from refitplane.agent.simulated import SimulatedAgent
from refitplane.protocol import Role
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.testing.cluster.agent_procs import process_resources
from refitplane.testing.cluster.proc_cluster import ProcCluster

TOKEN = "bench-admission-token"
JOB = "bench"


def _layout() -> Any:
    builder = LayoutBuilder()
    builder.add(TensorSpec.create("model.norm.weight", [8], "float32"), 0, ((0, 8),))
    return builder.build()


def _member(target: str, role: Role, replica: str = "") -> AgentSession:
    agent = SimulatedAgent(role)
    info = MemberInfo(job=JOB, role=role, replica_id=replica, host="127.0.0.1", device="cpu")
    session = AgentSession(target, info, agent, token=TOKEN, timeout_s=10)
    agent.session = session
    session.start()
    session.publish_layout(_layout())
    return session


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _probe_loop(url: str, started: Any, stop: Any, out: Any) -> None:
    """In a process of its own (the burst's client saturates this one's event loop and GIL,
    which would be measured instead of the server): GET `url`/healthz every 20 ms until
    `stop` (`started` set after the first), then send the latencies (inf for an answer other
    than 200)."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as probe:
        while not stop.is_set():
            begin = time.perf_counter()
            ok = probe.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - begin if ok else float("inf"))
            started.set()
            time.sleep(0.02)
    out.send(latencies)


async def _requests(url: str, verb: str, path: str, n: int) -> tuple[Counter[int], list[float]]:
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    latencies: list[float] = []

    async def one(http: httpx.AsyncClient) -> int:
        started = time.perf_counter()
        response = await http.request(verb, path, json={} if verb == "POST" else None)
        latencies.append(time.perf_counter() - started)
        return response.status_code

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=headers) as http:
        codes = Counter(await asyncio.gather(*(one(http) for _ in range(n))))
    return codes, latencies


def _burst(url: str, probe_url: str, verb: str, path: str, n: int) -> dict[str, Any]:
    """The burst, with /healthz probed meanwhile on the REST port and on the probe port."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    probers = []
    for target in (url, probe_url):
        receive, send = ctx.Pipe(duplex=False)
        started = ctx.Event()
        proc = ctx.Process(target=_probe_loop, args=(target, started, stop, send), daemon=True)
        proc.start()
        probers.append((proc, receive))
        if not started.wait(120):
            raise RuntimeError(f"the /healthz prober of {target} did not start")
    codes, latencies = asyncio.run(_requests(url, verb, path, n))
    stop.set()
    rest, port = (receive.recv() for _, receive in probers)
    for proc, _ in probers:
        proc.join(timeout=30)
    return {"codes": codes, "latencies": latencies, "rest": rest, "port": port}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triggers", type=int, nargs="*", default=[150, 500])
    parser.add_argument("--reads", type=int, nargs="*", default=[1000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ProcCluster(Path(tmp), token=TOKEN) as cluster:
        target = cluster.coordinator.grpc_target
        sessions = [_member(target, Role.TRAINER), _member(target, Role.GENERATOR, "a")]
        url = cluster.coordinator.http_url
        pid = cluster.coordinator.pid
        rows = []
        bursts = [("POST", f"/v1/jobs/{JOB}/refits", n) for n in args.triggers]
        bursts += [("GET", f"/v1/jobs/{JOB}/refits?limit=50", n) for n in args.reads]
        probe_url = cluster.coordinator.probe_url
        for verb, path, n in bursts:
            result = _burst(url, probe_url, verb, path, n)
            rss_mib = process_resources(pid)["rss_kb"] / 1024
            codes, lat, rest, port = (result[k] for k in ("codes", "latencies", "rest", "port"))
            rows.append(
                (
                    f"{n} x {verb} {path.split('?')[0]}",
                    ", ".join(f"{code}: {count}" for code, count in sorted(codes.items())),
                    codes.get(429, 0),
                    codes.get(503, 0),
                    statistics.median(lat) * 1000,
                    _pct(lat, 0.99) * 1000,
                    f"{_pct(rest, 0.99) * 1000:.1f} ({len(rest)})",
                    f"{_pct(port, 0.99) * 1000:.1f} ({len(port)})",
                    rss_mib,
                )
            )
        for session in sessions:
            session.close()
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print(
        "| burst | answers | 429 | 503 | p50 ms | p99 ms | /healthz p99 ms (probes): REST port "
        "| probe port | RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, answers, n429, n503, p50, p99, rest_p99, port_p99, rss in rows:
        print(
            f"| {name} | {answers} | {n429} | {n503} | {p50:.0f} | {p99:.0f} | "
            f"{rest_p99} | {port_p99} | {rss:.0f} |"
        )


if __name__ == "__main__":
    main()
