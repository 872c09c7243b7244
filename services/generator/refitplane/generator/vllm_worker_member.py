"""A vLLM worker's membership: its data-plane rank (`WorkerMember`, which receives when vLLM
calls the engine, can wait there for the coordinator's StartTransfer of a pre-armed update,
and remembers the refit and version it completed) and what an engine init registers as
(`registration`), for `vllm_engine.RefitplaneEngine`."""

from __future__ import annotations

import torch

from refitplane.agent.dataplane import DataPlaneMember, Prepared
from refitplane.agent.settings import AgentSettings
from refitplane.errors import InvalidArgument, TransferError
from refitplane.generator.vllm_contract import RefitInitInfo
from refitplane.protocol.messages import (
    AbortRefitCmd,
    LeaveGroupCmd,
    PrepareRefitCmd,
    StartTransferCmd,
)
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport

# Aborted refits remembered for a pre-armed update that reaches the worker after its abort.
_ABORTED_KEPT = 16


class StartNotSeen(TransferError):
    """A pre-armed update ended before its transfer began: the refit was aborted (`aborted`)
    or the coordinator's StartTransfer did not come in time. Nothing was received."""

    def __init__(self, message: str, *, aborted: bool) -> None:
        super().__init__(message)
        self.aborted = aborted
        self.weights_modified = False


class WorkerMember(DataPlaneMember):
    """A vLLM worker's data-plane rank: receives when vLLM calls the engine, and remembers
    which refit (and version, as the coordinator's PrepareRefit named it) it completed."""

    def __init__(self, shards: LocalShards, *, device: torch.device, local_host: str) -> None:
        super().__init__(lambda: shards, device=device, local_host=local_host, run_on_start=False)
        self.completed: tuple[str, int] | None = None
        # Under `_ready`: refits whose StartTransfer this rank saw and whose transfer has not
        # run yet, refits aborted lately, and a count of aborts that name no refit
        # (LeaveGroup, an AbortRefit of every refit): what a pre-armed update waits on.
        self._started: set[str] = set()
        self._aborted: dict[str, None] = {}
        self._aborts_unnamed = 0

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        if cmd.config is not None and not cmd.config.verify_checksums:
            # vLLM serves a version only once every rank verified what arrived (the
            # sidecar's RanksVerified wait, the API's report check): an unchecked transfer
            # would overwrite the live weights and then fail after that wait. Refused here,
            # before any byte moves.
            raise InvalidArgument(
                f"refit {cmd.refit_id}: a vLLM replica takes only verified transfers, and "
                "this one runs with checksums off (REFIT_VERIFY_CHECKSUMS=false on the "
                "coordinator); turn them on. Nothing was received",
                field="verify_checksums",
            )
        with self._ready:
            self._started.clear()  # one refit at a time: an older start is stale
        super().on_prepare_refit(cmd)

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        self.start_seen(cmd.refit_id)
        with self._ready:
            self._started.add(cmd.refit_id)
            self._ready.notify_all()

    def on_abort_now(self, cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        """From the stream thread: also releases a pre-armed update waiting for its start."""
        super().on_abort_now(cmd)
        with self._ready:
            if isinstance(cmd, AbortRefitCmd) and cmd.refit_id:
                self._aborted[cmd.refit_id] = None
                while len(self._aborted) > _ABORTED_KEPT:
                    del self._aborted[next(iter(self._aborted))]
            elif isinstance(cmd, AbortRefitCmd) or cmd.epoch >= self.epoch:
                self._aborts_unnamed += 1  # not a late LeaveGroup of an epoch already left
            self._ready.notify_all()

    def wait_for_start(self, refit_id: str, timeout_s: float) -> None:
        """A pre-armed update's wait (on vLLM's worker thread) for the coordinator's
        StartTransfer of `refit_id` to reach this rank; `StartNotSeen` at once when the refit
        is aborted (or the rank leaves its group) first, or after `timeout_s`."""
        with self._ready:
            unnamed = self._aborts_unnamed

            def aborted() -> None:
                if refit_id in self._aborted or self._aborts_unnamed != unnamed:
                    raise StartNotSeen(
                        f"refit {refit_id} was aborted before its StartTransfer reached this "
                        "rank: nothing was received",
                        aborted=True,
                    )

            self._wait_ready(
                lambda: refit_id in self._started,
                timeout_s,
                lambda: StartNotSeen(
                    f"refit {refit_id}: the coordinator's StartTransfer did not reach this "
                    f"rank within {timeout_s:g} s of the pre-armed update (update_info."
                    "start_wait_s); nothing was received",
                    aborted=False,
                ),
                check=aborted,
            )
            self._started.discard(refit_id)

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
