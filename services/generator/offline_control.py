"""Drive an in-process `vllm.LLM` the way the sidecar drives a vLLM server.

For RL loops that run vLLM offline (colocated or in the orchestrator's process) and for
tests: `Sidecar(settings, control=OfflineLLMControl(llm))`. An offline engine only
generates inside `llm.generate()`, so there is nothing to pause; the caller must not
generate from another thread while a refit runs.
"""

from __future__ import annotations

from typing import Any


class OfflineLLMControl:
    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def healthy(self) -> bool:
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        return None

    def init_engine(self, init_info: dict[str, Any]) -> int:
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        return 200

    def pause(self, mode: str) -> int:
        return 200

    def resume(self) -> int:
        return 200

    def start_update(self) -> int:
        self.llm.start_weight_update()
        return 200

    def update(self, update_info: dict[str, Any]) -> int:
        self.llm.update_weights({"update_info": update_info})
        return 200

    def finish(self, version: int) -> int:
        import inspect

        # vLLM 0.32 records the version; 0.26's finish_weight_update takes no argument.
        if "weight_version" in inspect.signature(self.llm.finish_weight_update).parameters:
            self.llm.finish_weight_update(str(version))
        else:
            self.llm.finish_weight_update()
        return 200

    def close(self) -> None:
        return None
