"""How the sidecar drives a vLLM server: the `EngineControl` verbs (`refitplane.replica.
control`: pause, weight update, resume, status) over vLLM's dev-mode HTTP API
(VLLM_SERVER_DEV_MODE=1). In-process engines implement the same protocol
(`offline_control.OfflineLLMControl`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from refitplane.errors import FailedPrecondition, Unavailable
from refitplane.generator.vllm_contract import ENGINE_ATTR
from refitplane.replica.control import ENGINE_STATUS_TIMEOUT_S

log = logging.getLogger("refitplane.sidecar")


class VllmControl:
    """vLLM's pause / weight-update / resume HTTP verbs (needs VLLM_SERVER_DEV_MODE=1)."""

    # httpx's client may be used from several threads: the sidecar pre-arms the update.
    PREARM_SAFE = True

    def __init__(self, base_url: str, *, timeout_s: float = 900.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0)
        )

    def close(self) -> None:
        self._http.close()

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"vLLM at {self.base_url} did not become healthy within {timeout_s:.0f} s"
                )
            time.sleep(1.0)

    def _post(
        self,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, str | list[str]] | None = None,
    ) -> int:
        try:
            response = self._http.post(path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise Unavailable(f"vLLM {path}: {exc}") from exc
        if response.status_code == 404:
            raise FailedPrecondition(f"vLLM has no {path}: start it with VLLM_SERVER_DEV_MODE=1")
        if response.status_code >= 400:
            # Not trusted as the outcome (see the module docstring), but worth a log line.
            log.warning("vLLM %s answered %d: %s", path, response.status_code, response.text[:300])
        return response.status_code

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return self._post("/init_weight_transfer_engine", body={"init_info": init_info})

    def pause(self, mode: str) -> int:
        return self._post("/pause", params={"mode": mode})

    def resume(self) -> int:
        return self._post("/resume")

    def start_update(self) -> int:
        return self._post("/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> int:
        return self._post("/update_weights", body={"update_info": update_info})

    def finish(self, version: int | None) -> int:
        body = None if version is None else {"weight_version": str(version)}
        return self._post("/finish_weight_update", body=body)

    def is_sleeping(self) -> bool:
        try:
            response = self._http.get("/is_sleeping", timeout=30.0)
        except httpx.HTTPError as exc:
            raise Unavailable(f"vLLM /is_sleeping: {exc}") from exc
        if response.status_code != 200:
            raise FailedPrecondition(
                f"vLLM answered {response.status_code} to /is_sleeping: REFIT_SLEEP_LEVEL needs "
                "VLLM_SERVER_DEV_MODE=1 and vLLM started with --enable-sleep-mode"
            )
        return bool(response.json().get("is_sleeping"))

    def wake_up(self, tags: list[str]) -> int:
        return self._post("/wake_up", params={"tags": list(tags)})

    def sleep(self, level: int) -> int:
        return self._post("/sleep", params={"level": str(level)})

    def engine_status(
        self, timeout_s: float = ENGINE_STATUS_TIMEOUT_S
    ) -> list[dict[str, Any]] | None:
        try:
            response = self._http.post(
                "/collective_rpc",
                json={"method": ENGINE_ATTR, "kwargs": {"op": "status"}},
                timeout=timeout_s,
            )
        except httpx.TimeoutException as exc:
            # Not "no status channel" (None): a vLLM that stopped answering must not read as
            # one whose workers hold their version.
            raise Unavailable(
                f"vLLM at {self.base_url} did not answer /collective_rpc (its workers' engine "
                f"status) within {timeout_s:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            log.debug("vLLM /collective_rpc: %s", exc)
            return None
        if response.status_code != 200:
            return None
        results = response.json().get("results")
        return results if isinstance(results, list) else None
