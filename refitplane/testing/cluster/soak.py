"""Soak: refits back to back on a cluster of real processes, with a crowd of registered
agents, while memory, threads, file descriptors and communicators of every process are
sampled. Used by `benchmarks/soak.py` (200 refits, 10 minutes) and, shortened, by CI.

The cluster: redis-server, the coordinator process, 2 trainer ranks (TP2) and 2 generator
replicas (TP2 and TP1) from `refitplane.testing.cluster.agent_procs`, moving the synthetic model over
Gloo. Every refit is a training step (new bytes) on both trainers, a trigger, and a wait for
COMMITTED; every few refits a generator's bytes are compared with the trainers'. The crowd:
N more members (job `crowd`) registered over grpc.aio from this process, each with a layout,
renewing its lease every ttl/3 for the whole run.

"Stable" means: every refit committed; communicators: each rank built one set and holds
exactly one (no rebuilds in a healthy run); threads and file descriptors of every process
at the last sample within `JITTER` of the first (taken after the warm-up); resident memory
grows by less than `rss_budget_kib` per process between those samples.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane.errors import Unavailable
from refitplane.protocol import RefitState, Role, convert
from refitplane.protocol import messages as m
from refitplane.protocol.channel import Metadata, aio_channel, member_metadata
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.testing.cluster.proc_cluster import ProcCluster
from refitplane.testing.cluster.synthetic_state import expected_digests

SOAK_ENV = {
    "REFIT_LEASE_TTL_S": "30",
    "REFIT_PREPARE_TIMEOUT_S": "30",
    "REFIT_TRANSFER_TIMEOUT_S": "60",
    "REFIT_GROUP_TIMEOUT_S": "30",
    "REFIT_VERIFY_TIMEOUT_S": "30",
    "REFIT_LOG_LEVEL": "WARNING",
}
CROWD_JOB = "crowd"
# How far threads / file descriptors of a process may move between the first and the last
# sample without counting as a leak.
JITTER = {"threads": 2, "fds": 4}


@dataclass
class Sample:
    refits: int
    seconds: float
    # process name → {"rss_kb", "threads", "fds"} (agents also "transports_open", "created")
    processes: dict[str, dict[str, int]]


@dataclass
class SoakReport:
    refits: int = 0
    committed: int = 0
    seconds: float = 0.0
    crowd: int = 0
    refit_seconds: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        times = sorted(self.refit_seconds) or [0.0]
        first, last = self.samples[0], self.samples[-1]
        growth = {
            name: {
                key: last.processes[name][key] - first.processes[name][key]
                for key in ("rss_kb", "threads", "fds")
            }
            for name in first.processes
            if name in last.processes
        }
        return {
            "refits": self.refits,
            "committed": self.committed,
            "seconds": round(self.seconds, 1),
            "crowd": self.crowd,
            "refit_p50_ms": round(statistics.median(times) * 1e3, 1),
            "refit_p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3, 1),
            "growth_first_to_last_sample": growth,
            "problems": self.problems,
        }


class Crowd:
    """N registered members on grpc.aio, on their own event loop thread."""

    def __init__(self, target: str, size: int, *, job: str = CROWD_JOB) -> None:
        self.target = target
        self.size = size
        self.job = job
        self.registered = 0
        self.renewals = 0
        self.errors = 0
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-crowd", daemon=True)

    def start(self, timeout_s: float = 120.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise Unavailable(f"the crowd did not register within {timeout_s:g} s")
        if self.registered != self.size:
            raise Unavailable(f"only {self.registered} of {self.size} crowd members registered")

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        channel = aio_channel(self.target)
        # The generated stubs are typed for sync channels; on an aio channel calls are awaited.
        stub: Any = agent_pb2_grpc.AgentServiceStub(channel)
        gate = asyncio.Semaphore(64)
        try:
            members = await asyncio.gather(*(self._join(stub, i, gate) for i in range(self.size)))
            self._ready.set()
            renewers = [
                asyncio.create_task(self._renew(stub, member_id, metadata, every))
                for member_id, metadata, every in members
                if member_id
            ]
            await self._stop.wait()
            for task in renewers:
                task.cancel()
            await asyncio.gather(*renewers, return_exceptions=True)
        finally:
            self._ready.set()
            await channel.close()

    async def _join(
        self, stub: Any, i: int, gate: asyncio.Semaphore
    ) -> tuple[str, Metadata, float]:
        # Generator replicas of one rank each, so the crowd is a valid (large) topology.
        info = m.MemberInfo(
            job=self.job, role=Role.GENERATOR, rank=0, world_size=1, replica_id=f"r{i}"
        )
        spec = TensorSpec.create("model.norm.weight", [64], "float32")
        builder = LayoutBuilder()
        builder.add(spec, 0, ((0, 64),))
        layout = builder.build()
        async with gate:
            try:
                reply = await stub.Register(convert.register_to_proto(info), timeout=30)
                metadata = member_metadata(None, reply.member_credential)
                await stub.PublishLayout(
                    apb.PublishLayoutRequest(
                        member_id=reply.member_id, layout=convert.layout_to_proto(layout, 0)
                    ),
                    timeout=30,
                    metadata=metadata,
                )
            except Exception:  # noqa: BLE001 - counted and reported by the soak
                self.errors += 1
                return "", (), 0.0
        self.registered += 1
        return reply.member_id, metadata, reply.renew_interval_s

    async def _renew(self, stub: Any, member_id: str, metadata: Metadata, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await stub.RenewLease(
                    apb.RenewLeaseRequest(member_id=member_id), timeout=30, metadata=metadata
                )
                self.renewals += 1
            except Exception:  # noqa: BLE001 - counted and reported by the soak
                self.errors += 1


def _sample(cluster: ProcCluster, refits: int, started: float) -> Sample:
    processes: dict[str, dict[str, int]] = {"coordinator": cluster.coordinator.resources()}
    if cluster.redis is not None:
        processes["redis"] = cluster.redis.resources()
    for agent in cluster.agents.values():
        status = agent.status()
        processes[agent.name] = {
            "rss_kb": status["rss_kb"],
            "threads": status["threads"],
            "fds": status["fds"],
            "transports_open": status["faults"]["transports_open"],
            "transports_created": status["faults"]["transports_created"],
        }
    return Sample(refits, time.monotonic() - started, processes)


def format_sample(sample: Sample) -> str:
    parts = [f"[{sample.seconds:7.1f} s] refits {sample.refits:5d}"]
    for name, p in sample.processes.items():
        comm = f" comm {p['transports_open']}" if "transports_open" in p else ""
        parts.append(f"{name}: {p['rss_kb'] / 1024:.0f} MiB {p['threads']} thr {p['fds']} fd{comm}")
    return " | ".join(parts)


def run_soak(
    workdir: Path,
    *,
    refits: int = 200,
    duration_s: float = 0.0,
    crowd: int = 1000,
    sample_every_s: float = 30.0,
    warmup_refits: int = 5,
    check_every: int = 10,
    rss_budget_kib: int = 32 * 1024,
    log: Callable[[str], None] = print,
) -> SoakReport:
    """At least `refits` refits and at least `duration_s` seconds of them, back to back."""
    report = SoakReport(crowd=crowd)
    with ProcCluster(workdir, coordinator_env=SOAK_ENV) as cluster:
        cluster.add_trainers(2)
        cluster.add_replica("rep-0", 2)
        cluster.add_replica("rep-1", 1)
        cluster.wait_ready()
        crowd_members = Crowd(cluster.coordinator.grpc_target, crowd)
        crowd_members.start()
        log(f"{crowd_members.registered} crowd members registered")
        try:
            _refit_loop(cluster, report, refits, duration_s, sample_every_s, warmup_refits,
                        check_every, log)  # fmt: skip
        finally:
            crowd_members.stop()
        if crowd_members.errors:
            report.problems.append(f"crowd: {crowd_members.errors} failed calls")
        log(f"crowd: {crowd_members.renewals} lease renewals, {crowd_members.errors} errors")
    _judge(report, rss_budget_kib)
    return report


def _refit_loop(
    cluster: ProcCluster,
    report: SoakReport,
    refits: int,
    duration_s: float,
    sample_every_s: float,
    warmup_refits: int,
    check_every: int,
    log: Callable[[str], None],
) -> None:
    version = 0
    for _ in range(warmup_refits):  # group epoch, plan cache, allocator warm-up
        version += 1
        final = cluster.refit(version)
        if final.state is not RefitState.COMMITTED:
            report.problems.append(f"warm-up refit {version}: {final.state.value} {final.reason}")
    started = time.monotonic()
    report.samples.append(_sample(cluster, 0, started))
    log(format_sample(report.samples[-1]))
    next_sample = started + sample_every_s
    while report.refits < refits or time.monotonic() - started < duration_s:
        version += 1
        t0 = time.monotonic()
        final = cluster.refit(version)
        report.refit_seconds.append(time.monotonic() - t0)
        report.refits += 1
        if final.state is RefitState.COMMITTED:
            report.committed += 1
        else:
            report.problems.append(f"refit {version}: {final.state.value} {final.reason}")
        if report.refits % check_every == 0:
            _check_bytes(cluster, version, report)
        if time.monotonic() >= next_sample:
            report.samples.append(_sample(cluster, report.refits, started))
            log(format_sample(report.samples[-1]))
            next_sample += sample_every_s
    report.seconds = time.monotonic() - started
    report.samples.append(_sample(cluster, report.refits, started))
    log(format_sample(report.samples[-1]))


def _check_bytes(cluster: ProcCluster, version: int, report: SoakReport) -> None:
    for agent in cluster.generators:
        status = agent.status()
        want = expected_digests(version, status["rank"], status["world"], scale=status["scale"])
        if status["version"] != version or status["digests"] != want:
            report.problems.append(f"{agent.name} does not hold version {version}")


def _judge(report: SoakReport, rss_budget_kib: int) -> None:
    if len(report.samples) < 2:
        report.problems.append("fewer than two samples")
        return
    if report.committed != report.refits:
        report.problems.append(f"{report.refits - report.committed} refits did not commit")
    first, last = report.samples[0], report.samples[-1]
    for name, start in first.processes.items():
        end = last.processes.get(name)
        if end is None:
            report.problems.append(f"{name} disappeared")
            continue
        for key in ("threads", "fds"):
            # Client connections and pooled threads come and go by a few; a leak grows with
            # every refit, far beyond this.
            if abs(end[key] - start[key]) > JITTER[key]:
                report.problems.append(f"{name}: {key} {start[key]} -> {end[key]}")
        if end["rss_kb"] - start["rss_kb"] > rss_budget_kib:
            report.problems.append(
                f"{name}: RSS grew {(end['rss_kb'] - start['rss_kb']) // 1024} MiB"
            )
        if "transports_open" in end and (end["transports_open"], end["transports_created"]) != (
            1,
            1,
        ):
            report.problems.append(
                f"{name}: {end['transports_open']} communicator sets open, "
                f"{end['transports_created']} built (want 1 and 1)"
            )
