"""The replica controller's engine verbs over one of vLLM's weight-sync clients
(`ClientControl`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

from refitplane.replica.control import ENGINE_STATUS_TIMEOUT_S, CallerPausedControl, call_verb


class ClientControl(CallerPausedControl):
    """The sidecar's engine verbs over a `VLLMWeightSyncClient` (HTTP or Ray). Pausing is
    the caller's, as for every vLLM backend, so pause/resume do nothing here. A client's
    exception becomes the HTTP status it carries (the sidecar takes outcomes from the
    coordinator, but refuses to go on after a failed start)."""

    def __init__(self, client: VLLMWeightSyncClient) -> None:
        self.client = client

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return call_verb(
            "init_weight_transfer_engine",
            lambda: self.client.init_weight_transfer_engine(init_info),
        )

    def start_update(self) -> int:
        return call_verb("start_weight_update", self.client.start_weight_update)

    def update(self, update_info: dict[str, Any]) -> int:
        return call_verb("update_weights", lambda: self.client.update_weights(update_info))

    def finish(self, version: int | None) -> int:
        label = None if version is None else str(version)
        return call_verb("finish_weight_update", lambda: self.client.finish_weight_update(label))

    def engine_status(
        self, timeout_s: float = ENGINE_STATUS_TIMEOUT_S
    ) -> list[dict[str, Any]] | None:
        # vLLM's weight-sync clients have no status channel (the controller exports no
        # staging metric; each worker's status has it).
        return None
