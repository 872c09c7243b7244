"""The generator sidecar (`refit-sidecar`): one per vLLM replica, next to the vLLM server.

It registers the replica's controller with the coordinator, initialises the refitplane
engine in vLLM's workers (`/init_weight_transfer_engine`), and drives every refit:

    PrepareRefit   → POST /pause?mode=<keep|wait|abort>, POST /start_weight_update
    StartTransfer  → POST /update_weights {"update_info": {"refit_id", "version"}}
                     (each worker receives its shards and reports to the coordinator)
                   → every rank of this replica verified?  (asked of the coordinator)
                   → POST /finish_weight_update (post-load processing / staged reload)
                   → still no failure? → POST /resume → report ReplicaUpdated(version)

Success is read from the coordinator, never from HTTP status codes (vLLM's replies can
belong to an earlier call after a worker error). A refit that fails before any weight was
written resumes the engine on its old weights; one that may have written some (a live or
layerwise receive had started — every `receive_mode` but "staged" writes weights during
the transfer — or a reload at finish) leaves it paused and the sidecar not ready
(`/readyz` 503) until a later refit commits — the replica never serves a version it does
not fully hold.

`/metrics` (Prometheus) exports `refit_generator_staging_peak_bytes{replica, rank}`: each
worker's staging memory peak during the last refit (checkpoint tensors it staged, not the
executor's ring), read from the engines' status after every refit (vLLM's dev-mode
`/collective_rpc`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import Field

from refitplane.agent.handler import NullHandler
from refitplane.agent.session import AgentSession
from refitplane.agent.settings import AgentSettings
from refitplane.client.sync import RefitClient
from refitplane.errors import FailedPrecondition, TransferError, Unavailable
from refitplane.generator.vllm_http_control import EngineControl, VllmControl
from refitplane.lifecycle import StartupError, bind_failure
from refitplane.protocol import RefitState, Role
from refitplane.protocol.messages import (
    AbortRefitCmd,
    MemberInfo,
    PrepareRefitCmd,
    StartTransferCmd,
)
from refitplane.protocol.models import Refit

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
    # The workers' receive mode (init_info.mode): auto, layerwise or staged (vllm_staging).
    receive_mode: Literal["auto", "layerwise", "staged"] = "auto"
    sidecar_port: int = 8090
    sidecar_host: str = "0.0.0.0"
    vllm_start_timeout_s: float = 900.0
    update_timeout_s: float = 900.0
    register_timeout_s: float = 120.0
    log_level: str = "INFO"
    # One JSON object per log line, as the coordinator's REFIT_LOG_JSON.
    log_json: bool = False


@dataclass
class SidecarState:
    version: int = 0
    paused: bool = False
    degraded: bool = False
    refit_id: str = ""
    # This sidecar started a weight update in vLLM that it has not finished yet.
    update_open: bool = False
    # The engine may have written live weights of the current refit.
    weights_touched: bool = False
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Steps:
    """Milliseconds per step of one update, for the log line an operator reads."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._steps: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self._steps.append((step, 1e3 * (now - self._last)))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {ms:.1f} ms" for step, ms in self._steps)


def touches_live_weights(receive_modes: Sequence[str]) -> bool:
    """Whether a transfer into ranks with these `receive_mode` labels may change the served
    weights before it verified: every mode but "staged" does (live bytes land as they
    arrive; layerwise buckets are applied as they complete), as does a rank without the
    label. The coordinator reads the labels the same way."""
    return not receive_modes or any(mode != "staged" for mode in receive_modes)


class StagingMetrics:
    """`refit_generator_staging_peak_bytes{replica, rank}` from the engines' status."""

    def __init__(self, registry: CollectorRegistry, replica_id: str) -> None:
        self.replica_id = replica_id
        self.peak = Gauge(
            "refit_generator_staging_peak_bytes",
            "Staging memory (checkpoint tensors staged for vLLM's reload, not the transfer "
            "ring) a generator worker held at most during its last refit",
            ("replica", "rank"),
            registry=registry,
        )

    def update(self, statuses: Sequence[dict[str, Any]]) -> None:
        for status in statuses:
            peak = status.get("staging_peak_bytes")
            if isinstance(peak, int):
                self.peak.labels(self.replica_id, str(status.get("rank", -1))).set(peak)


class SidecarMember(NullHandler):
    """The replica controller's command handler."""

    def __init__(
        self,
        control: EngineControl,
        client: RefitClient,
        *,
        job: str,
        replica_id: str,
        default_pause_mode: str,
        verify_wait_s: float = 30.0,
        metrics: StagingMetrics | None = None,
    ) -> None:
        self.control = control
        self.client = client
        self.job = job
        self.replica_id = replica_id
        self.default_pause_mode = default_pause_mode
        self.verify_wait_s = verify_wait_s
        self.state = SidecarState()
        self.session: AgentSession | None = None
        self._lock = threading.Lock()
        # Read from the topology at PrepareRefit (`_read_ranks`), for group epoch
        # `_ranks_epoch`.
        self._rank_ids: set[str] = set()
        self._touches_live = False
        self._ranks_epoch = -1
        self.metrics = metrics

    def attach(self, session: AgentSession) -> None:
        self.session = session

    # -- commands -----------------------------------------------------------------------------

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        mode = cmd.pause_mode or self.default_pause_mode
        with self._lock:
            self.state.refit_id = cmd.refit_id
            self.state.weights_touched = False
        # Read now (once per group epoch: ranks only change with the group) so that nothing
        # but the update itself runs between StartTransfer and the ranks' transfer.
        if self._ranks_epoch != cmd.epoch or not self._rank_ids:
            self._read_ranks(cmd.epoch)
        status = self.control.pause(mode)
        if not _ok(status):
            raise FailedPrecondition(
                f"vLLM refused to pause (mode {mode}, HTTP {status}) for refit {cmd.refit_id}"
            )
        self.state.paused = True
        status = self.control.start_update()
        if not _ok(status):
            # Nothing was started, so the abort that follows must not finish anything.
            raise FailedPrecondition(
                f"vLLM refused /start_weight_update (HTTP {status}) for refit {cmd.refit_id}; "
                "is another update in progress? See the vLLM log"
            )
        self.state.update_open = True
        assert self.session is not None
        self.session.report_prepared(cmd.refit_id)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        steps = _Steps()
        if self.state.refit_id != cmd.refit_id:  # no PrepareRefit seen in this process
            self._read_ranks(-1)
        self.state.weights_touched = self._touches_live
        self.control.update({"refit_id": cmd.refit_id, "version": cmd.version})
        steps.mark("update")
        try:
            self._require_ranks_verified(cmd.refit_id)
            steps.mark("verified")
        except TransferError:
            self._close_update(cmd.refit_id)
            if not self.state.weights_touched:
                self.control.resume()
                self.state.paused = False
            raise
        self.state.weights_touched = True  # finish applies staged weights, or post-processes
        status = self.control.finish(cmd.version)
        self.state.update_open = False
        if not _ok(status):
            # vLLM did not take the version (its reload failed, or a rank did not apply).
            raise self._failed(
                f"vLLM answered HTTP {status} to /finish_weight_update of refit {cmd.refit_id}; "
                "see the vLLM log",
                touched=True,
            )
        steps.mark("finish")
        refit = self.client.get(cmd.refit_id)
        if refit.state in {RefitState.FAILED, RefitState.CANCELLED}:
            raise self._failed(
                f"refit {refit.state.value} while finishing: {refit.message}", touched=True
            )
        steps.mark("checked")
        self.control.resume()
        steps.mark("resume")
        with self._lock:
            self.state.paused = False
            self.state.degraded = False
            self.state.version = cmd.version
            self.state.last_error = ""
        # Before the report: once it commits, the caller may use the engine again.
        self._export_staging()
        assert self.session is not None
        self.session.report_replica_updated(cmd.refit_id, cmd.version)
        steps.mark("reported")
        log.info("replica %s serves version %d: %s", self.replica_id, cmd.version, steps)

    def on_abort_refit(self, cmd: AbortRefitCmd) -> None:
        with self._lock:
            if cmd.refit_id and cmd.refit_id != self.state.refit_id:
                return
            touched = self.state.weights_touched
        if self.state.update_open:  # else vLLM has no update of ours to close
            self._close_update(cmd.refit_id)
        if not self.state.paused:
            return
        if touched:
            self._degrade(f"refit {cmd.refit_id} aborted ({cmd.reason}) after weights were written")
        elif self.state.degraded:
            log.warning(
                "replica %s stays paused: it still holds the weights of an earlier failed refit",
                self.replica_id,
            )
        else:
            self.control.resume()
            self.state.paused = False

    # -- helpers -------------------------------------------------------------------------------

    def _close_update(self, refit_id: str) -> None:
        """vLLM needs every started update finished: drop what was staged first, so this
        finish applies nothing of a refit that failed somewhere in the replica (and names no
        version: the replica keeps the one it fully holds)."""
        self.control.update({"refit_id": refit_id, "action": "discard"})
        self.control.finish(None)
        self._export_staging()
        # Last: once the update reads closed, this sidecar makes no more vLLM calls for it.
        self.state.update_open = False

    def _export_staging(self) -> None:
        """Refresh the staging gauge after a refit (never fails one: metrics only)."""
        if self.metrics is None:
            return
        try:
            statuses = self.control.engine_status()
        except Exception:  # a metric must not fail a refit
            log.debug("reading the engines' status for metrics failed", exc_info=True)
            return
        if statuses:
            self.metrics.update(statuses)

    def _replica_ranks(self) -> list[Any]:
        topo = self.client.topology(self.job)
        return [
            m for m in topo.members if m.role == Role.GENERATOR and m.replica_id == self.replica_id
        ]

    def _read_ranks(self, epoch: int) -> None:
        """The replica's rank member ids, and whether they receive into live parameters."""
        ranks = self._replica_ranks()
        self._rank_ids = {m.member_id for m in ranks}
        self._touches_live = touches_live_weights([m.labels.get("receive_mode", "") for m in ranks])
        self._ranks_epoch = epoch

    def _require_ranks_verified(self, refit_id: str) -> None:
        ranks = self._rank_ids
        deadline = time.monotonic() + self.verify_wait_s
        delay = 0.002  # the ranks' reports usually land first: look again soon, then back off
        while True:
            refit: Refit = self.client.get(refit_id)
            if refit.state in {RefitState.FAILED, RefitState.CANCELLED}:
                raise self._failed(
                    f"refit {refit.state.value}: {refit.reason} {refit.message}",
                    touched=self.state.weights_touched,
                )
            done = {
                r.member_id
                for r in refit.ranks
                if r.member_id in ranks
                and r.tensors_total > 0
                and r.tensors_verified == r.tensors_total
            }
            if ranks and done == ranks:
                return
            if time.monotonic() > deadline:
                missing = sorted(ranks - done)
                raise self._failed(
                    f"ranks {missing} of replica {self.replica_id} did not verify the transfer",
                    touched=self.state.weights_touched,
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _failed(self, message: str, *, touched: bool) -> TransferError:
        if touched:
            self._degrade(message)
        exc = TransferError(message)
        exc.weights_modified = touched  # type: ignore[attr-defined]
        return exc

    def _degrade(self, message: str) -> None:
        log.error("replica %s not ready: %s", self.replica_id, message)
        with self._lock:
            self.state.degraded = True
            self.state.last_error = message


def _ok(status: int) -> bool:
    return 200 <= status < 300


def wait_replica_ranks(client: RefitClient, job: str, replica_id: str, timeout_s: float) -> None:
    """Wait until every vLLM worker of the replica registered and published its layout."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = [
            m
            for m in client.topology(job).members
            if m.role == Role.GENERATOR and m.replica_id == replica_id
        ]
        if ranks and all(m.layout_digest for m in ranks) and len(ranks) == ranks[0].world_size:
            return
        if time.monotonic() > deadline:
            raise Unavailable(
                f"vLLM's workers did not register with the coordinator as replica {replica_id!r} "
                f"of job {job!r} within {timeout_s:.0f} s (found {len(ranks)}); is vLLM started "
                """with --weight-transfer-config '{"backend": "refitplane"}' and refit-plane """
                "installed in its environment? See the vLLM log"
            )
        time.sleep(0.2)


class _HealthHandler(BaseHTTPRequestHandler):
    sidecar: Sidecar

    def do_GET(self) -> None:
        s = self.sidecar
        if self.path == "/healthz":
            self._reply(200 if s.alive else 503, {"alive": s.alive})
        elif self.path == "/readyz":
            ready = s.ready()
            self._reply(200 if ready else 503, {"ready": ready, **s.member.state.as_dict()})
        elif self.path == "/status":
            self._reply(200, {"ready": s.ready(), **s.member.state.as_dict()})
        elif self.path == "/metrics":
            data = generate_latest(s.registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("health: " + format, *args)


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
        )
        info = MemberInfo(
            job=settings.job,
            role=Role.GENERATOR_SIDECAR,
            rank=0,
            world_size=1,
            replica_id=settings.replica_id,
            host=settings.host,
            device="",
        )
        self.session = AgentSession(
            settings.coordinator, info, self.member, token=token, tls_ca=tls, timeout_s=30.0
        )
        self.member.attach(self.session)
        self.alive = False
        self._http: ThreadingHTTPServer | None = None

    def ready(self) -> bool:
        return self.alive and not self.member.state.degraded and self.control.healthy()

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
        self.session.start()
        status = self.control.init_engine(
            {
                "coordinator": self.settings.coordinator,
                "job": self.settings.job,
                "replica_id": self.settings.replica_id,
                "mode": self.settings.receive_mode,
            }
        )
        if not _ok(status):
            raise Unavailable(
                f"vLLM answered HTTP {status} to /init_weight_transfer_engine; see the vLLM log"
            )
        self._wait_workers_registered()
        self.alive = True
        log.info("replica %s ready for refits", self.settings.replica_id)

    def _wait_workers_registered(self) -> None:
        s = self.settings
        wait_replica_ranks(self.client, s.job, s.replica_id, s.register_timeout_s)

    def close(self) -> None:
        self.session.close()
        self.client.close()
        self.control.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
