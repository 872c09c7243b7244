"""vLLM's trainer-side weight-sync client (`VLLMWeightSyncClient`, a four-method protocol)
over an in-process `vllm.LLM`, so tests drive vLLM's own trainer API
(`WeightTransferTrainerFactory.trainer_init(..., client=...)`) against an engine they
already started offline instead of a `vllm serve` behind `HTTPVLLMWeightSyncClient`.
"""

from __future__ import annotations

from typing import Any


class OfflineLLMClient:
    """The four verbs of `VLLMWeightSyncClient`, each one `LLM` call (which raises where
    the HTTP server answers an error status)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
