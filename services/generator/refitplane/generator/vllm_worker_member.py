"""A vLLM worker's membership: its data-plane rank (`WorkerMember`, which receives when vLLM
calls the engine and remembers the refit and version it completed) and what an engine init
registers as (`registration`), for `vllm_engine.RefitplaneEngine`."""

from __future__ import annotations

import torch

from refitplane.agent.dataplane import DataPlaneMember, Prepared
from refitplane.agent.settings import AgentSettings
from refitplane.generator.vllm_contract import RefitInitInfo
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport


class WorkerMember(DataPlaneMember):
    """A vLLM worker's data-plane rank: receives when vLLM calls the engine, and remembers
    which refit (and version, as the coordinator's PrepareRefit named it) it completed."""

    def __init__(self, shards: LocalShards, *, device: torch.device, local_host: str) -> None:
        super().__init__(lambda: shards, device=device, local_host=local_host, run_on_start=False)
        self.completed: tuple[str, int] | None = None

    def after_transfer(
        self, prepared: Prepared, report: TransferReport | None, *, weights_modified: bool
    ) -> None:
        self.completed = (prepared.refit_id, prepared.version) if report is not None else None

    def completed_version(self, refit_id: str) -> int:
        """The version of refit `refit_id` if its transfer was the last one completed here
        (as the coordinator's PrepareRefit named it), else 0."""
        done = self.completed
        return done[1] if done is not None and done[0] == refit_id else 0


def registration(info: RefitInitInfo, env: AgentSettings | None = None) -> tuple[str, ...]:
    """What an init registers as (coordinator, job and replica first: the init info's, else
    the REFIT_* environment's); a second init with the same is a no-op."""
    env = env or AgentSettings()
    return (
        info.coordinator or env.coordinator,
        info.job or env.job,
        info.replica_id or env.replica_id,
        info.host,
        info.mode,
        ",".join(info.fallback_layers),
    )
