"""The trainer agent: a library each trainer rank imports.

    agent = TrainerAgent(coordinator="coord:50051", job="grpo-7b", rank=rank, world_size=world,
                         shards=lambda: megatron_shards(model, hf_config))
    agent.start()                        # register, lease, publish the layout
    for step in range(steps):
        loss = train_step(...)           # forward/backward may overlap a running refit
        with agent.updating_weights():   # waits for a refit still reading the weights
            optimizer.step()
        agent.refit(version=step + 1)    # optional: push now (any rank may; rank 0 usually)
    agent.close()

A rank that also trains the speculative-decoding draft its generators serve passes its
draft shards too (`draft_shards=`, the draft checkpoint's own names): they are published as
`draft.<name>` (`refitplane.protocol.draft`), and generators that refit their draft
(init_info `"draft": "refit"`) receive them in the same refit, under the same version.

Refits are served from the agent's own thread (and, on GPU, its own CUDA streams): sends
read the live parameters, under a read-lock that `updating_weights` excludes, so a refit
never reads half-updated weights. The hold expires after the transfer's timeout, so a
stuck refit can never block training forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from refitplane.agent.dataplane import DataPlaneMember, Prepared, local_address, placement_of
from refitplane.agent.session import AgentSession
from refitplane.agent.settings import AgentSettings
from refitplane.errors import TransferTimeout
from refitplane.protocol import Role
from refitplane.protocol.draft import with_draft
from refitplane.protocol.messages import MemberInfo, PrepareRefitCmd
from refitplane.protocol.models import Refit
from refitplane.reshard.delta_base import DeltaSnapshot
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport

log = logging.getLogger(__name__)

# Margin beyond the transfer's own timeout before a read hold is considered abandoned.
_HOLD_SLACK_S = 30.0


class WeightsGuard:
    """Excludes optimizer steps (writers) from refits reading the weights (one reader).

    A read hold is taken by the agent's thread when a refit is prepared and given back
    when it ends; it expires on its own after `expires_s`, so training never waits on a
    refit that died without telling.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writing = False
        self._hold_until: float | None = None
        # Set while a refit waits for a step to end before it reads the weights.
        self.refit_waiting = threading.Event()
        # Write holds begun so far: sums taken at the end of one describe the weights until
        # the next begins.
        self.writes = 0

    def hold(self, timeout_s: float, expires_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._writing:
                log.info("a refit waits for this rank's optimizer step before reading its weights")
            try:
                while self._writing:
                    self.refit_waiting.set()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TransferTimeout(
                            f"the optimizer step did not finish within {timeout_s:.0f} s; the refit cannot read the weights"
                        )
                    self._cond.wait(remaining)
            finally:
                self.refit_waiting.clear()
            self._hold_until = time.monotonic() + expires_s

    def release(self) -> None:
        with self._cond:
            self._hold_until = None
            self._cond.notify_all()

    @property
    def held(self) -> bool:
        with self._cond:
            return self._hold_until is not None and time.monotonic() < self._hold_until

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            while self._hold_until is not None:
                remaining = self._hold_until - time.monotonic()
                if remaining <= 0:
                    log.warning("a refit's hold on the weights expired; continuing training")
                    self._hold_until = None
                    break
                self._cond.wait(remaining)
            self._writing = True
            self.writes += 1
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class _TrainerMember(DataPlaneMember):
    def __init__(
        self,
        guard: WeightsGuard,
        shards: Callable[[], LocalShards],
        *,
        device: torch.device,
        local_host: str,
        step_timeout_s: float,
        delta_snapshot: DeltaSnapshot,
    ) -> None:
        super().__init__(
            shards, device=device, local_host=local_host, delta_snapshot=delta_snapshot
        )
        self.guard = guard
        self.step_timeout_s = step_timeout_s

    def before_transfer(self, cmd: PrepareRefitCmd) -> None:
        assert cmd.config is not None
        self.guard.hold(self.step_timeout_s, cmd.config.timeout_s + _HOLD_SLACK_S)

    def weight_writes(self) -> int | None:
        return self.guard.writes

    def after_transfer(
        self, prepared: Prepared, report: TransferReport | None, *, weights_modified: bool
    ) -> None:
        self.guard.release()


class TrainerAgent:
    """Connects one trainer rank to the coordinator and serves its sends."""

    def __init__(
        self,
        *,
        coordinator: str | None = None,
        job: str | None = None,
        rank: int,
        world_size: int,
        shards: LocalShards | Callable[[], LocalShards],
        device: torch.device | str = "cpu",
        host: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        step_timeout_s: float = 600.0,
        labels: dict[str, str] | None = None,
        delta_snapshot: str | None = None,
        settings: AgentSettings | None = None,
        draft_shards: LocalShards | Callable[[], LocalShards] | None = None,
    ) -> None:
        """Arguments left out come from `settings` (default: `AgentSettings()`, the REFIT_*
        environment): the coordinator, job, token (REFIT_AUTH_TOKEN_FILE wins over
        REFIT_AUTH_TOKEN), CA bundle and host. `delta_snapshot` ("device" or "host";
        default REFIT_DELTA_SNAPSHOT, else "device"): where this rank keeps the bytes of its
        last send while the coordinator runs delta refits (REFIT_DELTA=auto|on): one copy of
        the rank's shards. `draft_shards`: this rank's shards of the speculative-decoding
        draft, named as in the draft's checkpoint, published under the `draft.` prefix."""
        env = settings or AgentSettings()
        coordinator, job = env.require(coordinator=coordinator, job=job)
        self.job = job
        self.rank = rank
        self._token = token if token is not None else env.token()
        self._coordinator = coordinator
        self._tls_ca = tls_ca if tls_ca is not None else env.tls_ca()
        self.device = torch.device(device)
        self._shards_fn = _published(shards, draft_shards)
        self.guard = WeightsGuard()
        host = host or env.host or local_address()
        snapshot = DeltaSnapshot(delta_snapshot or env.delta_snapshot)
        self.member = _TrainerMember(
            self.guard,
            self._shards_fn,
            device=self.device,
            local_host=host,
            step_timeout_s=step_timeout_s,
            delta_snapshot=snapshot,
        )
        node, gpu = placement_of(self.device, env.node)
        info = MemberInfo(
            job=job,
            role=Role.TRAINER,
            rank=rank,
            world_size=world_size,
            host=host,
            device=str(self.device),
            node=node,
            device_uuid=gpu,
            labels={
                # What a delta base costs this rank (shown by `refitctl topology`): one copy
                # of its shards, kept only while the coordinator runs delta refits.
                "delta_snapshot": snapshot.placement.value,
                "delta_snapshot_bytes": str(_shard_bytes(self._shards_fn())),
                **(labels or {}),
            },
        )
        self.session = AgentSession(
            coordinator, info, self.member, token=self._token, tls_ca=self._tls_ca
        )
        self.member.attach(self.session)

    def start(self) -> None:
        self.session.start()
        self.publish()

    def publish(self) -> str:
        """Publish this rank's layout (only sent when it changed); returns its digest."""
        return self.session.publish_layout(self._shards_fn().layout(self.rank))

    @contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Wrap the optimizer step: waits for a refit that is reading the weights."""
        with self.guard.writing():
            yield
            if self.device.type == "cuda":
                # Refit streams must see the finished step.
                torch.cuda.current_stream(self.device).synchronize()
                # Colocated (CUDA IPC link copies): the next refit's sender checksums, taken
                # now on a side stream, still inside the step's hold.
                self.member.presum_after_step(self.guard.writes)

    def refit(
        self,
        version: int = 0,
        *,
        wait: bool = True,
        timeout_s: float = 600.0,
        idempotency_key: str = "",
    ) -> Refit:
        """Trigger a refit of the job's generators to `version` (0: the next one), e.g. right
        after `optimizer.step()`. With an explicit version the idempotency key defaults to
        the step, so every rank may call this and only one refit happens."""
        from refitplane.client.sync import RefitClient

        key = idempotency_key or (f"{self.job}:version:{version}" if version else "")
        with RefitClient(self._coordinator, token=self._token, tls_ca=self._tls_ca) as client:
            record = client.trigger(self.job, version=version, idempotency_key=key)
            return client.wait(record.refit_id, timeout_s=timeout_s) if wait else record

    def close(self) -> None:
        self.session.close()
        self.member.close()


def _published(
    shards: LocalShards | Callable[[], LocalShards],
    draft: LocalShards | Callable[[], LocalShards] | None,
) -> Callable[[], LocalShards]:
    """What the rank publishes: its shards, and the draft's under the draft prefix (built
    once where both are fixed registries, else at every call, as the shards are)."""
    if draft is None:
        return shards if callable(shards) else (lambda: shards)
    if not callable(shards) and not callable(draft):
        both = with_draft(shards, draft)
        return lambda: both
    target_fn = shards if callable(shards) else (lambda: shards)
    draft_fn = draft if callable(draft) else (lambda: draft)
    return lambda: with_draft(target_fn(), draft_fn())


def _shard_bytes(shards: LocalShards) -> int:
    return sum(sv.tensor.numel() * sv.tensor.element_size() for sv in shards)
