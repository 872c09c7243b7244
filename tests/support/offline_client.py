"""vLLM's trainer-side weight-sync client (`VLLMWeightSyncClient`, a four-method protocol)
over an in-process `vllm.LLM`, so tests drive vLLM's own trainer API
(`WeightTransferTrainerFactory.trainer_init(..., client=...)`) against an engine they
already started offline instead of a `vllm serve` behind `HTTPVLLMWeightSyncClient`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


@contextlib.contextmanager
def vllm_trainer_api(llm: Any, *, job: str, source: Any, draft_source: Any = None) -> Iterator[Any]:
    """vLLM's own trainer API with the refitplane backend against the offline `llm`:
    `WeightTransferTrainerFactory.trainer_init(RefitplaneTrainerInitInfo(...),
    client=OfflineLLMClient(llm), source=source)` for one trainer rank, against a
    coordinator of its own. Yields the trainer engine (the caller runs `send_weights()`);
    the engine and the coordinator stop after."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from refitplane.testing.coordinator import ENGINE_WORLD_LEASE_TTL_S, start_coordinator
    from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo

    coordinator = start_coordinator(
        lease_ttl_s=ENGINE_WORLD_LEASE_TTL_S, transfer_timeout_s=120.0, verify_timeout_s=120.0
    )
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            RefitplaneTrainerInitInfo(
                rank=0,
                coordinator=coordinator.grpc_target,
                job=job,
                replica_id="api",
                world_size=1,
                host="127.0.0.1",
                timeout_s=300.0,
                draft_source=draft_source,
            ),
            client=OfflineLLMClient(llm),
            source=source,
        )
        try:
            yield engine
        finally:
            engine.shutdown()
    finally:
        coordinator.stop()
