"""Overload: concurrent REST triggers and reads against a real coordinator process on a real
Redis (issue 22, section 4). Prints one row per burst: answers by status (429 vs 503), request
latency p50/p99, `/healthz` p99 while the burst runs, and the coordinator's RSS.

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


async def _burst(url: str, verb: str, path: str, n: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    latencies: list[float] = []
    probes: list[float] = []

    async def one(http: httpx.AsyncClient) -> int:
        started = time.perf_counter()
        response = await http.request(verb, path, json={} if verb == "POST" else None)
        latencies.append(time.perf_counter() - started)
        return response.status_code

    async with (
        httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=headers) as http,
        httpx.AsyncClient(base_url=url, timeout=120) as probe,
    ):
        task = asyncio.gather(*(one(http) for _ in range(n)))
        while not task.done():
            started = time.perf_counter()
            await probe.get("/healthz")
            probes.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)
        codes = Counter(await task)
    return {"codes": codes, "latencies": latencies, "probes": probes}


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
        for verb, path, n in bursts:
            result = asyncio.run(_burst(url, verb, path, n))
            rss_mib = process_resources(pid)["rss_kb"] / 1024
            codes, lat, probes = result["codes"], result["latencies"], result["probes"]
            rows.append(
                (
                    f"{n} x {verb} {path.split('?')[0]}",
                    ", ".join(f"{code}: {count}" for code, count in sorted(codes.items())),
                    codes.get(429, 0),
                    codes.get(503, 0),
                    statistics.median(lat) * 1000,
                    _pct(lat, 0.99) * 1000,
                    _pct(probes, 0.99) * 1000,
                    len(probes),
                    rss_mib,
                )
            )
        for session in sessions:
            session.close()
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print("| burst | answers | 429 | 503 | p50 ms | p99 ms | /healthz p99 ms (probes) | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, answers, n429, n503, p50, p99, h99, probes, rss in rows:
        print(
            f"| {name} | {answers} | {n429} | {n503} | {p50:.0f} | {p99:.0f} | "
            f"{h99:.1f} ({probes}) | {rss:.0f} |"
        )


if __name__ == "__main__":
    main()
