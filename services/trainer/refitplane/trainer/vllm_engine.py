"""The trainer side of the "refitplane" backend in vLLM's weight-transfer API (vLLM >= 0.28).

A team on vLLM's API switches to refitplane by naming the backend and the coordinator:

    from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        RefitplaneTrainerInitInfo(rank=rank),        # was NCCLTrainerInitInfo(...)
        client=HTTPVLLMWeightSyncClient(base_url),   # or RayVLLMWeightSyncClient(...)
        source=ModuleSource(model),
    )
    ...
    engine.send_weights()                            # every rank, after each step

with `REFIT_COORDINATOR` / `REFIT_JOB` set (or `coordinator=` / `job=`), and vLLM started
with `--weight-transfer-config '{"backend": "refitplane"}'`. What changes underneath:

- `trainer_init` (every rank) publishes the rank's shards ONCE, as `TrainerAgent` does: for
  a `ModuleSource` / `DTensorModuleSource` the views of its parameters (DTensor local
  shards, plain tensors whole: `dtensor_shards`), for a `ShardsSource` whatever its
  factory returns (e.g. `megatron_shards`). Nothing is gathered. Rank 0 also becomes the
  replica's controller (what `refit-sidecar` is for a `vllm serve` of its own): it calls
  `client.init_weight_transfer_engine` so vLLM's workers register with the coordinator.
- `send_weights` (every rank) triggers one refit (all ranks trigger with the same
  idempotency key, so there is exactly one) and waits for it: the coordinator's plan moves
  each slice from the rank holding it to the vLLM rank needing it, checksummed; the
  controller drives `start_weight_update` → `update_weights` → `finish_weight_update(
  version)` through the client, so vLLM reports the refit's version only once every rank
  verified. It returns when the refit committed (the caller may then step the optimizer)
  and raises `WeightSyncError` naming the reason when it did not. The refit reads a rank's
  weights only while that rank is inside `send_weights`: one triggered by a rank that
  finished its step first waits, at PREPARING, for the others' `send_weights` (their
  optimizer steps may still be changing what they would send).

A replica serving a speculative-decoding draft gets it refit with the target, in the same
refit under one version, when the trainers pass its weights as
`RefitplaneTrainerInitInfo(..., draft_source=ModuleSource(draft_model))` (or a
`ShardsSource`; named as in the draft's checkpoint, published as `draft.<name>`).

Pausing generation stays the caller's, as with every vLLM backend. Any other
`WeightSource` works too, at a cost: rank 0 keeps one staging copy of what it yields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from refitplane.agent.session import AgentSession
from refitplane.client.sync import RefitClient
from refitplane.errors import FailedPrecondition, InvalidArgument, TransferError
from refitplane.protocol import Reason, Refit, RefitState, Role
from refitplane.replica import vllm_backend
from refitplane.replica.control import wait_replica_ranks
from refitplane.replica.controller import SidecarMember
from refitplane.reshard.shards import LocalShards
from refitplane.trainer.agent import TrainerAgent
from refitplane.trainer.vllm_client_control import ClientControl
from refitplane.trainer.vllm_sync_settings import shared_run_id, sync_settings
from refitplane.trainer.vllm_weight_sources import StagedSource, in_place_shards

if TYPE_CHECKING:
    from refitplane.trainer.vllm_sync_settings import SyncSettings

log = logging.getLogger(__name__)

BACKEND_NAME = vllm_backend.BACKEND_NAME
# A trainer process builds no vLLM engine, so vLLM never loads plugins there: make the
# backend known to `WeightTransferTrainerFactory` as soon as its init info is importable.
vllm_backend.register()


@dataclass(kw_only=True)
class RefitplaneTrainerInitInfo(TrainerInitInfo):
    """Where the coordinator is and who this trainer is. Every field has a default from
    the environment, so `RefitplaneTrainerInitInfo(rank=rank)` is enough in a pod the Helm
    chart set up."""

    backend: ClassVar[str] = BACKEND_NAME

    coordinator: str = ""  # gRPC host:port; default REFIT_COORDINATOR
    job: str = ""  # default REFIT_JOB
    # The replica the client reaches. Default REFIT_REPLICA_ID, else derived from the
    # client (the same on every rank).
    replica_id: str = ""
    # Trainer ranks that call trainer_init; 0: torch.distributed's world size (1 without).
    world_size: int = 0
    # Shared by the ranks of one training run, so their triggers name one refit per
    # send_weights. "": rank 0 makes one and broadcasts it over torch.distributed.
    run_id: str = ""
    # The coordinator as vLLM's workers reach it (default: `coordinator`).
    generator_coordinator: str = ""
    # send_weights refits every replica of the job, not only the client's.
    all_replicas: bool = False
    # The address peers reach this rank at (default REFIT_HOST, else the host's address).
    host: str = ""
    # Longest send_weights, and longest wait for the vLLM workers / other ranks at init.
    timeout_s: float = 600.0
    init_timeout_s: float = 300.0
    # The speculative-decoding draft the replica serves (a draft model, an EAGLE head,
    # DeepSeek-V3's MTP layers), refit with the target in the same refit under one version:
    # this rank's draft weights, named as in the draft's checkpoint, from a ModuleSource /
    # DTensorModuleSource of the draft or a ShardsSource. vLLM's workers are then told
    # `"draft": "refit"`. None: the replica keeps its draft as loaded.
    draft_source: WeightSource | None = None


class WeightSyncError(TransferError, RuntimeError):
    """A weight sync that did not commit; `reason` is the coordinator's, `refit_id` names it."""

    def __init__(
        self, message: str, *, reason: str = Reason.TRANSFER_FAILED, refit_id: str = ""
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.refit_id = refit_id


class RefitplaneTrainerEngine(TrainerWeightTransferEngine[RefitplaneTrainerInitInfo]):
    init_info_cls = RefitplaneTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool,
        settings: SyncSettings,
        rank: int,
        run_id: str,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.settings = settings
        self.rank = rank
        self.run_id = run_id
        self.rounds = 0
        self.agent: TrainerAgent | None = None
        # The record of the last committed refit (bytes on the wire, which replicas took a
        # delta), for callers that report it.
        self.last_refit: Refit | None = None
        self.controller: AgentSession | None = None
        # Rank 0: the replica's controller (what refit-sidecar runs for a server).
        self.controller_member: SidecarMember | None = None
        self._refits: RefitClient | None = None
        self._staged: StagedSource | None = None
        # The replica refits its speculative draft with the target (init_info.draft_source).
        self.refits_draft = False
        # Held from trainer_init to send_weights and again after it: the caller may be
        # changing the weights (its optimizer step), so no refit reads them (`_training`).
        self._training = ExitStack()

    @classmethod
    def trainer_init(
        cls,
        init_info: RefitplaneTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        config: Any = None,  # the trainer_init of some vLLM builds passes a config; unused
    ) -> Self:
        if source is None:
            raise ValueError("the refitplane trainer engine needs a WeightSource")
        rank = int(init_info.rank)
        settings = sync_settings(init_info, client)
        run_id = shared_run_id(settings, rank)
        engine = cls(
            client=client,
            source=source,
            is_sender=rank == 0,
            settings=settings,
            rank=rank,
            run_id=run_id,
        )
        try:
            engine._start(source, init_info.draft_source)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _start(self, source: WeightSource, draft_source: WeightSource | None) -> None:
        s = self.settings
        shards = in_place_shards(source)
        draft = _draft_shards(draft_source, source, target_in_place=shards is not None)
        self.refits_draft = draft is not None
        self._refits = RefitClient(s.coordinator, token=s.token, tls_ca=s.tls_ca)
        world = s.world_size
        if shards is None:
            # Only rank 0 stages (and takes part); the others just iterate at each send.
            world = 1
            self._staged = StagedSource(source, _default_device())
            staged = self._staged.shards
            shards = lambda: staged  # noqa: E731 - the staging never changes
        first = next(iter(shards()), None)
        device = first.tensor.device if first is not None else torch.device("cpu")
        if self._staged is None or self.is_sender:
            self.agent = TrainerAgent(
                coordinator=s.coordinator,
                job=s.job,
                rank=self.rank if self._staged is None else 0,
                world_size=world,
                shards=shards,
                device=device,
                host=s.host,
                token=s.token,
                tls_ca=s.tls_ca,
                step_timeout_s=s.timeout_s,
                labels={"engine": "vllm-trainer", "run_id": self.run_id},
                draft_shards=draft,
            )
            # Before the agent can be asked to prepare anything (see `_training`).
            self._train()
            self.agent.start()
        if self.is_sender:
            self._start_controller()
        self._wait_trainers(world)

    def _start_controller(self) -> None:
        """Rank 0 drives the replica behind the client, as refit-sidecar does for a server."""
        s = self.settings
        assert self._refits is not None
        control = ClientControl(self.client)
        member = SidecarMember(
            control, self._refits, job=s.job, replica_id=s.replica_id, default_pause_mode="keep"
        )
        self.controller = member.connect(
            s.coordinator,
            host=s.host,
            token=s.token,
            tls_ca=s.tls_ca,
            labels={"engine": "vllm-trainer", "run_id": self.run_id},
        )
        self.controller_member = member
        self.controller.start()
        init_info = {
            "coordinator": s.generator_coordinator,
            "job": s.job,
            "replica_id": s.replica_id,
        }
        if self.refits_draft:
            # vLLM's workers refit their draft with the target (left out otherwise: the
            # server's REFIT_DRAFT decides, as before).
            init_info["draft"] = "refit"
        status = control.init_engine(init_info)
        if status != 200:
            raise FailedPrecondition(
                f"vLLM refused /init_weight_transfer_engine ({status}); is it started with "
                """--weight-transfer-config '{"backend": "refitplane"}'? See its log"""
            )
        wait_replica_ranks(self._refits, s.job, s.replica_id, s.init_timeout_s)

    def _wait_trainers(self, world: int) -> None:
        """Return once every trainer rank of this run registered and published, so the
        first send_weights of a fast rank does not trigger before a slow one joined."""
        assert self._refits is not None
        timeout = self.settings.init_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            published = {
                m.rank
                for m in self._refits.topology(self.settings.job).members
                if m.role is Role.TRAINER
                and m.labels.get("run_id") == self.run_id
                and m.layout_digest
            }
            if len(published) >= world:
                return
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - published)
                raise WeightSyncError(
                    f"trainer rank(s) {missing} of run {self.run_id} did not publish their "
                    f"layouts within {timeout:g} s; does every rank call trainer_init?",
                    reason=Reason.MEMBERS_MISSING,
                )
            time.sleep(0.05)

    def _train(self) -> None:
        """The caller may change the weights from now until its next send_weights: a refit
        prepared meanwhile (another rank's send_weights triggers it) waits, at PREPARING,
        for this rank's send_weights before it reads them."""
        if self.agent is not None:  # None after shutdown
            self._training.enter_context(self.agent.updating_weights())

    def send_weights(self) -> None:
        """One refit, on every rank: returns once it committed (the weights it read may then
        change), raises `WeightSyncError` otherwise. The refit reads this rank's weights
        only inside this call: the first rank's trigger starts it, and it waits for every
        other rank's send_weights (up to the coordinator's prepare timeout), so no rank's
        optimizer step can still be changing what it sends."""
        s = self.settings
        if self._staged is not None:
            self._staged.refill(keep=self.is_sender)
            if not self.is_sender:
                return  # nothing of the source stays here; rank 0 sends it all
        if self.agent is None or self._refits is None:
            raise FailedPrecondition("send_weights after shutdown")
        self.rounds += 1
        self.agent.publish()  # a no-op unless the parameters were re-allocated
        key = f"{s.job}:{self.run_id}:{self.rounds}"
        targets = [] if s.all_replicas else [s.replica_id]
        self._training.close()  # the weights hold still: refits may read them now
        try:
            refit = self._refits.trigger(s.job, target_replicas=targets, idempotency_key=key)
            final = self._refits.wait(refit.refit_id, timeout_s=s.timeout_s)
        finally:
            # Waits until a refit still reading the weights lets go of them (one that
            # failed elsewhere may still be sending from here), so the caller's next step
            # never changes them under a transfer.
            self._train()
        if final.state is not RefitState.COMMITTED:
            raise WeightSyncError(
                f"refit {final.refit_id} (version {final.version}) {final.state.value}: "
                f"{final.reason}: {final.message}",
                reason=final.reason or final.state.value,
                refit_id=final.refit_id,
            )
        self.last_refit = final
        log.info(
            "refit %s committed version %d (%d bytes, %d on the wire; delta to %s)",
            final.refit_id,
            final.version,
            final.bytes_total,
            final.bytes_on_wire,
            ",".join(final.delta_replicas) or "no replica",
        )

    def shutdown(self) -> None:
        self._training.close()
        for close in (
            self.controller.close if self.controller is not None else None,
            self.agent.close if self.agent is not None else None,
            self._refits.close if self._refits is not None else None,
        ):
            if close is None:
                continue
            try:
                close()
            except Exception:
                log.exception("refitplane trainer engine: shutdown")
        self.controller = None
        self.agent = None
        self._refits = None


def _draft_shards(
    draft_source: WeightSource | None, source: WeightSource, *, target_in_place: bool
) -> Callable[[], LocalShards] | None:
    """This rank's draft shards (`init_info.draft_source`), published in place beside the
    target's (`source`, in place when `target_in_place`); refused where they cannot be."""
    if draft_source is None:
        return None
    draft = in_place_shards(draft_source)
    if draft is None:
        raise InvalidArgument(
            f"init_info.draft_source is a {type(draft_source).__name__}: a draft is published "
            "in place, from a ModuleSource / DTensorModuleSource of the draft or a ShardsSource",
            field="draft_source",
        )
    if not target_in_place:
        raise InvalidArgument(
            f"init_info.draft_source needs the target published in place too, not staged from "
            f"a {type(source).__name__} (rank 0 alone sends a staged source): pass a "
            "ModuleSource, DTensorModuleSource or ShardsSource",
            field="draft_source",
        )
    return draft


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
