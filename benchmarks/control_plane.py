#!/usr/bin/env python3
"""Control-plane benchmark: registration throughput and trigger-to-command latency.

    python benchmarks/control_plane.py                      # both stores, default sizes
    python benchmarks/control_plane.py --stores redis --refits 200 --json

Runs the real coordinator as a separate process (`python -m refitplane.coordinator`) on
loopback, once with the embedded store and once with Redis (a `redis-server` started
here), and drives it from this process with simulated agents on grpc.aio (no data plane):

1. registration: N agents (default 1,000) each Register and PublishLayout, all at once
   (at most --concurrency calls in flight). Target: < 5 s for 1,000.
2. trigger-to-command latency: 64 agents (trainers and generator replicas) hold their
   command streams open and answer every command at once; each refit is triggered over
   gRPC and the time until each agent's PrepareRefit arrives is recorded. Target: p99 of
   trigger → every participant's PrepareRefit < 20 ms. Group formation and planning
   happen in warm-up refits (they are not per-step costs: plans are cached and the group
   is kept across refits).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc, orchestrator_pb2_grpc
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane.protocol import RefitState, Role, convert
from refitplane.protocol import messages as m
from refitplane.protocol.channel import Metadata, aio_channel, member_metadata
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec

TENSORS = 8  # per layout
ROWS = 1024


# --- processes ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "",
             "--appendonly", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.2),
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def coordinator(redis_url: str, *, lease_ttl_s: float = 30.0) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="bench-coord-") as tmp:
        port_file = Path(tmp) / "ports.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_")}
        env.update(
            REFIT_REDIS_URL=redis_url,
            REFIT_LOG_LEVEL="WARNING",
            REFIT_LEASE_TTL_S=str(lease_ttl_s),
            REFIT_GRPC_HOST="127.0.0.1",
            REFIT_HTTP_HOST="127.0.0.1",
        )
        cmd = [sys.executable, "-m", "refitplane.coordinator", "--grpc-port", "0",
               "--http-port", "0", "--lane-port", "0", "--port-file", str(port_file), "--env-file", str(Path(tmp) / "none")]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, cwd=tmp)
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("coordinator did not start")
                time.sleep(0.02)
            yield f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --- simulated agents ------------------------------------------------------------------------------


def rows_layout(rank: int, world: int) -> Layout:
    b = LayoutBuilder()
    step = ROWS // world
    for t in range(TENSORS):
        spec = TensorSpec.create(f"model.layers.{t}.mlp.down_proj.weight", (ROWS, 64), "bfloat16")
        b.add(spec, rank, ((rank * step, (rank + 1) * step), (0, 64)))
    return b.build()


@dataclass
class Agent:
    """One member on grpc.aio that answers every command at once."""

    stub: agent_pb2_grpc.AgentServiceStub
    role: Role
    rank: int
    world: int
    replica: str = ""
    member_id: str = ""
    # Token-less benchmark coordinator: the member credential alone.
    metadata: Metadata = ()
    renew_every: float = 5.0
    prepared_at: dict[str, float] = field(default_factory=dict)
    plans: dict[str, cpb.RankPlan] = field(default_factory=dict)
    # Plans by (digest, rank): PrepareRefit carries a body only the first time.
    held: dict[tuple[str, int], cpb.RankPlan] = field(default_factory=dict)

    async def register(self, job: str) -> None:
        info = m.MemberInfo(
            job=job, role=self.role, rank=self.rank, world_size=self.world, replica_id=self.replica
        )
        resp = await self.stub.Register(convert.register_to_proto(info), timeout=30)
        self.member_id = resp.member_id
        self.metadata = member_metadata(None, resp.member_credential)
        self.renew_every = resp.renew_interval_s

    async def publish(self, layout: Layout) -> None:
        await self.stub.PublishLayout(
            apb.PublishLayoutRequest(
                member_id=self.member_id, layout=convert.layout_to_proto(layout, self.rank)
            ),
            timeout=30,
            metadata=self.metadata,
        )

    async def _report(self, refit_id: str, body: m.ReportBody) -> None:
        await self.stub.Report(
            convert.report_to_proto(m.Report(self.member_id, refit_id, body)),
            timeout=30,
            metadata=self.metadata,
        )

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every)
            await self.stub.RenewLease(
                apb.RenewLeaseRequest(member_id=self.member_id), timeout=30, metadata=self.metadata
            )

    async def serve(self) -> None:
        """Answer every command at once. Commands are read straight off the protobuf (no
        conversion of the plan), so this process measures the coordinator, not itself."""
        stream = self.stub.StreamCommands(
            apb.StreamCommandsRequest(member_id=self.member_id), metadata=self.metadata
        )
        async for raw in stream:
            received = time.perf_counter()
            kind = raw.WhichOneof("command")
            if kind == "create_rendezvous":
                await self._report("", m.RendezvousReady(raw.create_rendezvous.epoch, b"bench"))
            elif kind == "join_group":
                await self._report("", m.GroupJoined(raw.join_group.epoch))
            elif kind == "prepare_refit":
                prepare = raw.prepare_refit
                refit_id = prepare.refit_id
                self.prepared_at[refit_id] = received
                key = (prepare.plan_digest, prepare.plan_rank)
                if prepare.HasField("plan"):
                    self.held[key] = prepare.plan
                self.plans[refit_id] = self.held[key]
                await self._report(refit_id, m.Prepared())
            elif kind == "start_transfer":
                refit_id = raw.start_transfer.refit_id
                plan = self.plans.pop(refit_id)
                received_bytes = sum(link.nbytes for link in plan.recvs)
                tensors = len({p.tensor for link in plan.recvs for p in link.pieces})
                await self._report(
                    refit_id,
                    m.TransferDone(
                        bytes_sent=sum(link.nbytes for link in plan.sends),
                        bytes_received=received_bytes,
                        tensors_verified=tensors,
                        tensors_total=tensors,
                    ),
                )


# --- phases ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def channel(target: str) -> AsyncIterator[grpc.aio.Channel]:
    ch = aio_channel(target)
    try:
        yield ch
    finally:
        await ch.close()


async def registration(target: str, n: int, concurrency: int) -> dict[str, float]:
    # Half trainer ranks, half generator ranks in replicas of 4, each with its layout.
    trainers = n // 2
    agents = [
        (Role.TRAINER, r, trainers, "") for r in range(trainers)
    ] + [
        (Role.GENERATOR, i % 4, 4, f"replica-{i // 4}") for i in range(n - trainers)
    ]  # fmt: skip
    layouts = {(w, r): rows_layout(r, w) for _, r, w, _ in agents}
    gate = asyncio.Semaphore(concurrency)
    async with channel(target) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        latencies: list[float] = []

        async def one(role: Role, rank: int, world: int, replica: str) -> None:
            async with gate:
                t0 = time.perf_counter()
                agent = Agent(stub, role, rank, world, replica)
                await agent.register("bench-registration")
                await agent.publish(layouts[(world, rank)])
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(one(*a) for a in agents))
        total = time.perf_counter() - started
    return {
        "agents": n,
        "seconds": total,
        "per_s": n / total,
        "p50_ms": _pct(latencies, 50) * 1e3,
        "p99_ms": _pct(latencies, 99) * 1e3,
    }


async def latency(target: str, n_agents: int, refits: int, warmup: int) -> dict[str, float]:
    trainers = n_agents // 2
    replicas = (n_agents - trainers) // 4
    async with channel(target) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        refit_stub = orchestrator_pb2_grpc.RefitServiceStub(ch)
        agents = [Agent(stub, Role.TRAINER, r, trainers) for r in range(trainers)]
        agents += [
            Agent(stub, Role.GENERATOR, r, 4, f"replica-{i}")
            for i in range(replicas)
            for r in range(4)
        ]
        for a in agents:
            await a.register("bench-latency")
            await a.publish(rows_layout(a.rank, a.world))
        tasks = [asyncio.create_task(a.serve()) for a in agents]
        tasks += [asyncio.create_task(a.renew_forever()) for a in agents]
        await asyncio.sleep(0.2)  # streams open
        per_agent: list[float] = []
        per_refit: list[float] = []
        try:
            for i in range(warmup + refits):
                t0 = time.perf_counter()
                refit = await refit_stub.TriggerRefit(
                    opb.TriggerRefitRequest(job="bench-latency", idempotency_key=f"step-{i}"),
                    timeout=30,
                )
                async for update in refit_stub.WatchRefit(
                    opb.WatchRefitRequest(refit_id=refit.refit_id), timeout=60
                ):
                    state = convert.refit_state_from_proto(update.state)
                    if state.terminal:
                        if state is not RefitState.COMMITTED:
                            raise RuntimeError(f"refit {i} {state.value}: {update.message}")
                        break
                if i < warmup:
                    continue
                arrivals = [a.prepared_at.pop(refit.refit_id) - t0 for a in agents]
                per_agent.extend(arrivals)
                per_refit.append(max(arrivals))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "agents": len(agents),
        "refits": refits,
        "p50_ms": _pct(per_agent, 50) * 1e3,
        "p99_ms": _pct(per_agent, 99) * 1e3,
        "all_p50_ms": _pct(per_refit, 50) * 1e3,
        "all_p99_ms": _pct(per_refit, 99) * 1e3,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


# --- main -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    for store in args.stores.split(","):
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(redis_server()) if store == "redis" else ""
            with coordinator(url) as target:
                reg = asyncio.run(registration(target, args.agents, args.concurrency))
            if url:
                subprocess.run(
                    ["redis-cli", "-u", url, "FLUSHALL"], check=False, capture_output=True
                )
            with coordinator(url) as target:
                lat = asyncio.run(latency(target, args.latency_agents, args.refits, args.warmup))
        results[store] = {"registration": reg, "latency": lat}
    return results


def render(results: dict[str, dict[str, dict[str, float]]]) -> str:
    stores = list(results)
    rows = [
        ("agents registered + layouts published", "registration", "agents", "{:.0f}"),
        ("registration wall time (s, target < 5)", "registration", "seconds", "{:.2f}"),
        ("registrations per second", "registration", "per_s", "{:.0f}"),
        ("per-agent register+publish p50 (ms)", "registration", "p50_ms", "{:.1f}"),
        ("per-agent register+publish p99 (ms)", "registration", "p99_ms", "{:.1f}"),
        ("latency agents", "latency", "agents", "{:.0f}"),
        ("refits measured", "latency", "refits", "{:.0f}"),
        ("trigger → PrepareRefit p50 (ms)", "latency", "p50_ms", "{:.2f}"),
        ("trigger → PrepareRefit p99 (ms)", "latency", "p99_ms", "{:.2f}"),
        ("trigger → all 64 prepared p50 (ms)", "latency", "all_p50_ms", "{:.2f}"),
        ("trigger → all 64 prepared p99 (ms, target < 20)", "latency", "all_p99_ms", "{:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  " + "  ".join(f"{s:>10}" for s in stores)]
    for label, phase, key, fmt in rows:
        cells = [fmt.format(results[s][phase][key]) for s in stores]
        lines.append(f"{label:<{width}}  " + "  ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", default="embedded,redis", help="comma list: embedded, redis")
    p.add_argument("--agents", type=int, default=1000, help="agents for the registration phase")
    p.add_argument("--concurrency", type=int, default=128, help="calls in flight when registering")
    p.add_argument("--latency-agents", type=int, default=64)
    p.add_argument("--refits", type=int, default=100, help="measured refits")
    p.add_argument("--warmup", type=int, default=3, help="refits before measuring")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args()
    results = run(args)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, grpcio {grpc.__version__}"
    )
    print(render(results))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
