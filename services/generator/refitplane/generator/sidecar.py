"""The generator sidecar (`refit-sidecar`): one per vLLM replica, next to the vLLM server.

It registers the replica's controller with the coordinator, initialises the refitplane
engine in vLLM's workers (`/init_weight_transfer_engine`), and drives every refit:

    PrepareRefit   → POST /pause?mode=<keep|wait|abort>, POST /start_weight_update
    StartTransfer  → POST /update_weights {"update_info": {"refit_id", "version"}}
                     (each worker receives its shards and reports to the coordinator)
                   → every rank of this replica verified?  (asked of the coordinator)
                   → POST /finish_weight_update (post-load processing / staged reload)
                   → report ReplicaUpdated(version) (accepted: no failure) → POST /resume

Success is read from the coordinator, never from HTTP status codes (vLLM's replies can
belong to an earlier call after a worker error). A refit that fails before any weight was
written resumes the engine on its old weights; one that may have written some (a live or
layerwise receive had started — every `receive_mode` but "staged" writes weights during
the transfer — or a reload at finish) leaves it paused and the sidecar not ready
(`/readyz` 503) until a later refit commits — the replica never serves a version it does
not fully hold. `/readyz` answers from what vLLM last said (its health, the version every
worker holds), asked on a thread of its own (`sidecar_readiness.WorkerCheck`), so a slow
vLLM never holds a probe.

`/metrics` (Prometheus) exports `refit_generator_staging_peak_bytes{replica, rank}`: each
worker's staging memory during its last completed transfer (the executor's ring for packed
messages plus the checkpoint tensors it staged: within REFIT_MAX_INFLIGHT_BYTES where layers
are staged a bucket at a time), read from the engines' status after every refit (vLLM's
dev-mode `/collective_rpc`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from http.server import ThreadingHTTPServer
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import Field, model_validator

from refitplane.agent.settings import AgentSettings
from refitplane.client.sync import RefitClient
from refitplane.errors import FailedPrecondition, Unavailable
from refitplane.generator.sidecar_readiness import WorkerCheck
from refitplane.generator.vllm_http_control import VllmControl
from refitplane.http_json import JsonRequestHandler
from refitplane.lifecycle import StartupError, bind_failure
from refitplane.protocol import RefitState
from refitplane.replica.control import (
    ENGINE_STATUS_TIMEOUT_S,
    CallerPausedControl,
    EngineControl,
    engine_init_failure,
    succeeded,
    wait_replica_ranks,
)
from refitplane.replica.controller import SidecarMember

log = logging.getLogger("refitplane.sidecar")

_TERMINAL = {RefitState.FAILED, RefitState.CANCELLED, RefitState.COMMITTED}


class SidecarSettings(AgentSettings):
    """Environment (prefix REFIT_, as every agent's: `AgentSettings`) or flags."""

    # Required here: a sidecar cannot guess its coordinator, job or replica.
    coordinator: str = Field(description="coordinator gRPC host:port")
    job: str
    replica_id: str
    vllm_url: str = "http://127.0.0.1:8000"
    # vLLM's /pause?mode= (the coordinator's REFIT_PAUSE_MODE can override it per refit).
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    # The workers' receive mode (init_info.mode): auto, live, layerwise or staged (vllm_staging).
    receive_mode: Literal["auto", "live", "layerwise", "staged"] = "auto"
    sidecar_port: int = 8090
    sidecar_host: str = "0.0.0.0"
    vllm_start_timeout_s: float = 900.0
    update_timeout_s: float = 900.0
    # The update pre-armed at PrepareRefit (docs/generator.md): how long vLLM's workers wait
    # for the coordinator's StartTransfer (an abort ends it at once); 0 sends /update_weights
    # at StartTransfer instead.
    prearm_wait_s: float = Field(default=60.0, ge=0, le=3600)
    register_timeout_s: float = 120.0
    log_level: str = "INFO"
    # One JSON object per log line, as the coordinator's REFIT_LOG_JSON.
    log_json: bool = False
    # How often vLLM's health and workers' versions are asked (a thread of its own), and
    # how old that answer may be before /readyz says not ready (sidecar_readiness.py).
    worker_check_interval_s: float = Field(default=2.0, gt=0)
    worker_check_max_age_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _worker_check_bounds(self) -> SidecarSettings:
        if self.worker_check_max_age_s <= self.worker_check_interval_s:
            raise ValueError(
                f"REFIT_WORKER_CHECK_MAX_AGE_S ({self.worker_check_max_age_s:g}) must exceed "
                f"REFIT_WORKER_CHECK_INTERVAL_S ({self.worker_check_interval_s:g}): every answer "
                "would be too old before the next one"
            )
        return self


class StagingMetrics:
    """`refit_generator_staging_peak_bytes{replica, rank}` from the engines' status."""

    def __init__(self, registry: CollectorRegistry, replica_id: str) -> None:
        self.replica_id = replica_id
        self.peak = Gauge(
            "refit_generator_staging_peak_bytes",
            "refitplane's staging memory (the transfer's staging ring plus checkpoint tensors "
            "staged for vLLM's reload) a generator worker held during its last transfer",
            ("replica", "rank"),
            registry=registry,
        )

    def update(self, statuses: Sequence[dict[str, Any]]) -> None:
        for status in statuses:
            peak = status.get("staging_peak_bytes")
            if isinstance(peak, int):
                self.peak.labels(self.replica_id, str(status.get("rank", -1))).set(peak)


class _HealthHandler(JsonRequestHandler):
    log_name = "health"
    log = log
    sidecar: Sidecar

    def do_GET(self) -> None:
        s = self.sidecar
        if self.path == "/healthz":
            self._reply(200 if s.alive else 503, {"alive": s.alive})
        elif self.path == "/readyz":
            ready, why = s.readiness()
            body = {"ready": ready, "message": why, **s.member.state.as_dict()}
            self._reply(200 if ready else 503, body)
        elif self.path == "/status":
            ready, why = s.readiness()
            self._reply(200, {"ready": ready, "message": why, **s.member.state.as_dict()})
        elif self.path == "/metrics":
            self._reply_bytes(200, generate_latest(s.registry), CONTENT_TYPE_LATEST)
        else:
            self._reply(404, {"error": f"no route {self.path}"})


class Sidecar:
    def __init__(self, settings: SidecarSettings, control: EngineControl | None = None) -> None:
        self.settings = settings
        token = settings.token()
        tls = settings.tls_ca()
        self.control: EngineControl = control or VllmControl(
            settings.vllm_url, timeout_s=settings.update_timeout_s
        )
        self.client = RefitClient(settings.coordinator, token=token, tls_ca=tls)
        self.registry = CollectorRegistry()
        self.member = SidecarMember(
            self.control,
            self.client,
            job=settings.job,
            replica_id=settings.replica_id,
            default_pause_mode=settings.pause_mode,
            metrics=StagingMetrics(self.registry, settings.replica_id),
            sleep_level=settings.sleep_level,
            # Only where the engine's verbs may be called from two threads at once: vLLM's HTTP
            # server, an in-process LLM behind its lock; not a caller's weight-sync client.
            prearm_wait_s=(
                settings.prearm_wait_s if getattr(self.control, "PREARM_SAFE", False) else 0.0
            ),
            update_wait_s=settings.update_timeout_s,
        )
        self.session = self.member.connect(
            settings.coordinator,
            host=settings.host,
            token=token,
            tls_ca=tls,
            labels={"sleep_level": str(settings.sleep_level)},
        )
        self.alive = False
        # vLLM did not answer its workers' status when last asked (`_engine_init_failure`).
        self._status_unanswered = False
        self._http: ThreadingHTTPServer | None = None
        self.workers = WorkerCheck(
            self._ask_workers,
            interval_s=settings.worker_check_interval_s,
            max_age_s=settings.worker_check_max_age_s,
            # An in-process LLM is driven from its caller's thread only: asked at /readyz.
            poll=not isinstance(self.control, CallerPausedControl),
        )

    def readiness(self) -> tuple[bool, str]:
        """Whether the replica can serve now, and why not: from what this sidecar knows and
        vLLM's last answer (`WorkerCheck`), never waiting for vLLM."""
        if not self.alive:
            return False, "starting or stopping"
        if self.member.state.degraded:
            return False, self.member.state.last_error or "the replica holds incomplete weights"
        return self.workers.ready()

    def ready(self) -> bool:
        return self.readiness()[0]

    def _ask_workers(self) -> str:
        """vLLM's answer for `WorkerCheck`: empty when it can serve."""
        if not self.control.healthy():
            return f"vLLM at {self.settings.vllm_url} is not healthy (/health)"
        # Never ready at a version its weights lost (vLLM's sleep at level 2); this also
        # lowers the sidecar's version to what the workers hold. An answer later than the
        # age /readyz accepts is no use: vLLM not answering by then is itself the answer.
        if not self.member.engines_hold_version(timeout_s=self.settings.worker_check_max_age_s):
            return "a vLLM worker holds incomplete weights (discarded by a level-2 sleep?)"
        return ""

    def listen(self) -> None:
        """Serve /healthz, /readyz, /status and /metrics; StartupError if the port is taken."""
        if self._http is not None:
            return
        handler = type("Health", (_HealthHandler,), {"sidecar": self})
        host, port = self.settings.sidecar_host, self.settings.sidecar_port
        try:
            self._http = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            flag = "--sidecar-port / REFIT_SIDECAR_PORT"
            raise StartupError(bind_failure("health checks", host, port, flag, exc)) from None
        threading.Thread(
            target=self._http.serve_forever, name="sidecar-health", daemon=True
        ).start()

    def start(self) -> None:
        self.listen()
        log.info("waiting for vLLM at %s", self.settings.vllm_url)
        self.control.wait_healthy(self.settings.vllm_start_timeout_s)
        # A restarted sidecar registers at the version vLLM's workers hold, not 0.
        self.member.seed_from_engines()
        self.session.start()
        status = self.control.init_engine(
            {
                "coordinator": self.settings.coordinator,
                "job": self.settings.job,
                "replica_id": self.settings.replica_id,
                "mode": self.settings.receive_mode,
                "draft": self.settings.draft,
            }
        )
        if not succeeded(status):
            # vLLM 0.32's API guard fails the verb when a worker's engine failed: the
            # workers' status names the reason (the tensor, the field).
            why = self._engine_init_failure()
            if why:
                raise FailedPrecondition(why)
            raise Unavailable(
                f"vLLM answered HTTP {status} to /init_weight_transfer_engine; see the vLLM log"
            )
        self._wait_workers_registered()
        self.workers.refresh()
        self.workers.start()
        self.alive = True
        log.info("replica %s ready for refits", self.settings.replica_id)

    def _wait_workers_registered(self) -> None:
        s = self.settings
        # Without vLLM 0.32's API guard (0.26) /init_weight_transfer_engine answers 200
        # even when a worker's engine failed (the engine never raises into vLLM): its
        # status says so, and the start fails with that reason at once, not at the
        # registration deadline. Each ask is bounded by the time left, so a vLLM that
        # stops answering cannot hold the wait past REFIT_REGISTER_TIMEOUT_S.
        try:
            wait_replica_ranks(
                self.client,
                s.job,
                s.replica_id,
                s.register_timeout_s,
                failure=self._engine_init_failure,
            )
        except Unavailable as exc:
            if not self._status_unanswered:
                raise
            raise Unavailable(
                f"{exc.message}. Nor did vLLM at {s.vllm_url} answer when last asked for its "
                "workers' status (/collective_rpc, within the time left): is it stuck?"
            ) from None

    def _engine_init_failure(self, within_s: float = ENGINE_STATUS_TIMEOUT_S) -> str:
        """Why vLLM's workers will not register (a worker whose engine failed to start),
        from their status asked within `within_s`; empty while none says so, or when vLLM
        did not answer in time (`_status_unanswered`)."""
        try:
            statuses = self.control.engine_status(timeout_s=within_s)
        except Unavailable:
            self._status_unanswered = True
            return ""
        self._status_unanswered = False
        return engine_init_failure(statuses)

    def close(self) -> None:
        self.workers.stop()
        self.session.close()
        self.member.close()
        self.client.close()
        self.control.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
