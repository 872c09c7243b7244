"""Prometheus metrics of one coordinator (its own registry, so tests can run several).

Label values are upper case throughout, as the wire vocabulary they come from (states,
phases, reasons, gRPC codes): `outcome="COMMITTED"`, `outcome="CREATED"`, `path="DELTA"`.
Units are base units (seconds, bytes, bytes per second). docs/operations.md lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from refitplane.protocol import MemberState, RefitState

_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# 10 MB/s (a loaded CPU host over Gloo) to 800 GB/s (NVLink across a node).
_THROUGHPUT_BUCKETS = tuple(
    gb * 1e9 for gb in (0.01, 0.1, 0.5, 1, 2, 5, 10, 25, 50, 100, 200, 400, 800)
)


class _MemberGauge(Collector):
    """Members by state, counted at scrape time from the live membership."""

    def __init__(self, count: Callable[[], Mapping[MemberState, int]]) -> None:
        self._count = count

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("refit_members", "Registered members by state", labels=["state"])
        counts = self._count()
        for state in MemberState:
            family.add_metric([state.value], counts.get(state, 0))
        yield family


class _ReplicaVersionGauge(Collector):
    """Each replica's version (the lowest its ranks and sidecar fully hold), read at scrape
    time. Bounded: one series per replica of a registered job."""

    def __init__(self, versions: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._versions = versions

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "refit_replica_version",
            "Weight version a generator replica fully holds",
            # Not "job": Prometheus' own target label would rename it to exported_job.
            labels=["refit_job", "replica"],
        )
        for job, replica, version in self._versions():
            family.add_metric([job, replica], version)
        yield family


class Metrics:
    def __init__(
        self,
        count_members: Callable[[], Mapping[MemberState, int]],
        replica_versions: Callable[[], Iterable[tuple[str, str, int]]] = tuple,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Per job where it pays and stays bounded (one series per job and outcome or reason):
        # "refit_job", as Prometheus' own "job" label names the scrape target.
        self.refits = Counter(
            "refit_refits",
            "Finished refits by job and outcome",
            ["refit_job", "outcome"],
            registry=r,
        )
        self.triggers = Counter(
            "refit_triggers", "Trigger requests by outcome", ["outcome"], registry=r
        )
        self.phase_seconds = Histogram(
            "refit_phase_duration_seconds",
            "Time refits spent per phase",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.refit_seconds = Histogram(
            "refit_duration_seconds",
            "Trigger-to-finish time of refits by job and outcome",
            ["refit_job", "outcome"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.bytes = Counter("refit_bytes", "Bytes moved by refits", registry=r)
        self.wire_bytes = Counter(
            "refit_wire_bytes",
            "Bytes senders put on the wire for committed refits (below refit_bytes_total by "
            "what delta refits saved)",
            registry=r,
        )
        self.delta_replicas = Counter(
            "refit_replica_updates",
            "Replica updates of committed refits by path: DELTA (changed words against the "
            "version the replica held) or FULL",
            ["path"],
            registry=r,
        )
        self.throughput = Histogram(
            "refit_throughput_bytes_per_second",
            "Bytes received per second of TRANSFERRING, per committed refit",
            buckets=_THROUGHPUT_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "refit_failures",
            "Failed refits by job and reason (PEER_FAILED, CHECKSUM_MISMATCH, TIMEOUT, ...)",
            ["refit_job", "reason"],
            registry=r,
        )
        self.epochs = Counter("refit_group_epochs", "Group epochs started", registry=r)
        self.rank_plans = Counter(
            "refit_rank_plans",
            "Rank plans in PrepareRefit commands: BODY (sent whole), REFERENCE (named "
            "only: the member holds it), RESENT (sent whole after the member reported it "
            "missing)",
            ["how"],
            registry=r,
        )
        self.reports = Counter(
            "refit_agent_reports",
            "Agent reports handled, by how they came: LANE (the control lane), STREAM (on a "
            "StreamReports stream) or UNARY (a Report call: older agents, and the fallback "
            "when a stream broke)",
            ["via"],
            registry=r,
        )
        self.lanes = Gauge(
            "refit_control_lanes",
            "Control lanes open (members that proved who they are on one)",
            registry=r,
        )
        self.lane_refusals = Counter(
            "refit_control_lane_refusals",
            "Control lane connections refused or closed for breaking its rules, by reason "
            "(UNAUTHENTICATED, NOT_FOUND, INVALID_ARGUMENT, HELLO_TIMEOUT, RATE_LIMITED, ...)",
            ["reason"],
            registry=r,
        )
        self.jobs_driven = Gauge(
            "refit_jobs_driven", "Jobs with a refit driver in this coordinator", registry=r
        )
        self.jobs_forgotten = Counter(
            "refit_jobs_forgotten",
            "Idle jobs forgotten after REFIT_JOB_IDLE_S (drivers stopped)",
            registry=r,
        )
        r.register(_MemberGauge(count_members))
        r.register(_ReplicaVersionGauge(replica_versions))

    def finished(
        self,
        outcome: RefitState,
        timings: Mapping[RefitState, float],
        total_s: float,
        *,
        job: str,
        reason: str = "",
    ) -> None:
        self.refits.labels(job, outcome.value).inc()
        if outcome is RefitState.FAILED:
            self.failures.labels(job, reason.upper() or "UNKNOWN").inc()
        self.refit_seconds.labels(job, outcome.value).observe(total_s)
        for phase, seconds in timings.items():
            self.phase_seconds.labels(phase.value).observe(seconds)
