"""Drive an in-process `vllm.LLM` the way the sidecar drives a vLLM server.

For RL loops that run vLLM offline (colocated or in the orchestrator's process) and for
tests: `Sidecar(settings, control=OfflineLLMControl(llm))`. An offline engine only
generates inside `llm.generate()`, so there is nothing to pause; the caller must not
generate from another thread while a refit runs.

The `LLM` verbs raise where the HTTP server answers an error status (the refitplane API
guard: 400 bad payload, 409 wrong state or unverified update, 500 engine failure, 501
draft updates); each is turned into that status, as `vllm_http_control.VllmControl` reports it.
"""

from __future__ import annotations

import inspect
from typing import Any

from refitplane.replica.control import ENGINE_STATUS_TIMEOUT_S, CallerPausedControl, call_verb


def offline_is_sleeping(llm: Any) -> bool:
    """Whether an offline `LLM` sleeps (its engine's answer; the `LLM` itself grew the
    method only in later vLLM releases)."""
    ask = getattr(llm, "is_sleeping", None) or llm.llm_engine.is_sleeping
    return bool(ask())


class OfflineLLMControl(CallerPausedControl):
    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return call_verb(
            "init_weight_transfer_engine",
            lambda: self.llm.init_weight_transfer_engine({"init_info": init_info}),
        )

    def start_update(self) -> int:
        return call_verb("start_weight_update", self.llm.start_weight_update)

    def update(self, update_info: dict[str, Any]) -> int:
        return call_verb(
            "update_weights", lambda: self.llm.update_weights({"update_info": update_info})
        )

    def finish(self, version: int | None) -> int:
        # vLLM 0.32 records the version; 0.26's finish_weight_update takes no argument.
        takes_version = (
            "weight_version" in inspect.signature(self.llm.finish_weight_update).parameters
        )
        if version is not None and takes_version:
            return call_verb(
                "finish_weight_update", lambda: self.llm.finish_weight_update(str(version))
            )
        return call_verb("finish_weight_update", self.llm.finish_weight_update)

    # Unlike pausing, sleeping is the engine's state: the caller puts it to sleep while the
    # trainer steps, and a refit wakes it (`replica.engine_steps`).
    def is_sleeping(self) -> bool:
        return offline_is_sleeping(self.llm)

    def wake_up(self, tags: list[str]) -> int:
        return call_verb("wake_up", lambda: self.llm.wake_up(tags=tags))

    def sleep(self, level: int) -> int:
        return call_verb("sleep", lambda: self.llm.sleep(level=level))

    def engine_status(
        self, timeout_s: float = ENGINE_STATUS_TIMEOUT_S
    ) -> list[dict[str, Any]] | None:
        # In-process: the call returns when the workers answer (nothing to cut short).
        statuses = self.llm.collective_rpc("weight_transfer_engine", kwargs={"op": "status"})
        return list(statuses) if isinstance(statuses, list) else None
