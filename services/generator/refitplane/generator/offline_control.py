"""Drive an in-process `vllm.LLM` the way the sidecar drives a vLLM server.

For RL loops that run vLLM offline (colocated or in the orchestrator's process) and for
tests: `Sidecar(settings, control=OfflineLLMControl(llm))`. An offline engine only
generates inside `llm.generate()`, so there is nothing to pause; the caller must not
generate from another thread while a refit runs.

The `LLM` verbs raise where the HTTP server answers an error status (the refitplane API
guard: 400 bad payload, 409 wrong state or unverified update, 500 engine failure, 501
draft updates); each is turned into that status, as `vllm_http_control.VllmControl` reports it.

vLLM's engine client is not thread-safe, but the sidecar pre-arms the update (it calls
`update` at PrepareRefit on a thread of its own, docs/generator.md): every verb here runs
under one lock, so the engine client is only ever used by one thread at a time. The
pre-armed update holds it until its workers answer; the sidecar makes no other call
meanwhile, and a status ask gives up after its timeout instead of waiting behind it. A
caller that uses the same `LLM` itself (generate, collective_rpc) takes that lock too,
through `engine()`: after a failed refit the sidecar's pre-armed update may still be in
vLLM, and two threads on the engine's socket abort the process (libzmq).

vLLM's /pause clears a server's prefix cache before its weights change; an offline engine
has no pause of its own (its caller stops generating), so its prefix cache would still hold
keys and values computed with the weights a refit replaces, and a prompt sharing a cached
prefix (a system prompt) would be served partly from the old weights after the refit. So
`pause` clears it, as vLLM's does (one engine-core call in PREPARING); where it cannot (a
request still running: the caller generated during a refit), the pause fails and the refit
with it, before any byte moves.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from refitplane.errors import Unavailable
from refitplane.replica.control import ENGINE_STATUS_TIMEOUT_S, CallerPausedControl, call_verb


def offline_is_sleeping(llm: Any) -> bool:
    """Whether an offline `LLM` sleeps (its engine's answer; the `LLM` itself grew the
    method only in later vLLM releases)."""
    ask = getattr(llm, "is_sleeping", None) or llm.llm_engine.is_sleeping
    return bool(ask())


class OfflineLLMControl(CallerPausedControl):
    # Its verbs may be called from two threads (the lock): the sidecar pre-arms the update.
    PREARM_SAFE = True

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._engine_client = threading.Lock()

    @contextlib.contextmanager
    def engine(self, timeout_s: float = 120.0) -> Iterator[Any]:
        """The `LLM`, for the caller's own calls while this control drives it: waits (at most
        `timeout_s`) until no verb of the sidecar's is in vLLM, and keeps them out meanwhile."""
        with self._engine_within(
            timeout_s,
            f"the vLLM engine stayed busy with the sidecar's verbs for {timeout_s:g} s "
            "(a pre-armed /update_weights not answered?); see the vLLM log",
        ):
            yield self.llm

    @contextlib.contextmanager
    def _engine_within(self, timeout_s: float, busy: str) -> Iterator[None]:
        """The engine client's lock, waited for at most `timeout_s` (then Unavailable(busy))."""
        if not self._engine_client.acquire(timeout=timeout_s):
            raise Unavailable(busy)
        try:
            yield
        finally:
            self._engine_client.release()

    def _verb(self, verb: str, fn: Callable[[], object]) -> int:
        with self._engine_client:
            return call_verb(verb, fn)

    def init_engine(self, init_info: dict[str, Any]) -> int:
        return self._verb(
            "init_weight_transfer_engine",
            lambda: self.llm.init_weight_transfer_engine({"init_info": init_info}),
        )

    def start_update(self) -> int:
        return self._verb("start_weight_update", self.llm.start_weight_update)

    def pause(self, mode: str) -> int:
        """Clears the prefix cache (module doc); `mode` is the caller's business offline."""
        return self._verb("reset_prefix_cache", self._reset_prefix_cache)

    def _reset_prefix_cache(self) -> None:
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                "vLLM could not clear its prefix cache: requests are still running in the "
                "engine (an offline LLM must not generate while a refit runs)"
            )

    def update(self, update_info: dict[str, Any]) -> int:
        return self._verb(
            "update_weights", lambda: self.llm.update_weights({"update_info": update_info})
        )

    def finish(self, version: int | None) -> int:
        # vLLM 0.32 records the version; 0.26's finish_weight_update takes no argument.
        takes_version = (
            "weight_version" in inspect.signature(self.llm.finish_weight_update).parameters
        )
        if version is not None and takes_version:
            return self._verb(
                "finish_weight_update", lambda: self.llm.finish_weight_update(str(version))
            )
        return self._verb("finish_weight_update", self.llm.finish_weight_update)

    # Unlike pausing, sleeping is the engine's state: the caller puts it to sleep while the
    # trainer steps, and a refit wakes it (`replica.engine_steps`).
    def is_sleeping(self) -> bool:
        with self._engine_client:
            return offline_is_sleeping(self.llm)

    def wake_up(self, tags: list[str]) -> int:
        return self._verb("wake_up", lambda: self.llm.wake_up(tags=tags))

    def sleep(self, level: int) -> int:
        return self._verb("sleep", lambda: self.llm.sleep(level=level))

    def engine_status(
        self, timeout_s: float = ENGINE_STATUS_TIMEOUT_S
    ) -> list[dict[str, Any]] | None:
        # In-process: the call returns when the workers answer (nothing to cut short), but
        # the wait for another verb (a pre-armed update) to end is bounded.
        with self._engine_within(
            timeout_s,
            f"vLLM's engine was busy with another verb (a weight update) for {timeout_s:g} s: "
            "its workers' engine status was not asked",
        ):
            statuses = self.llm.collective_rpc("weight_transfer_engine", kwargs={"op": "status"})
        return list(statuses) if isinstance(statuses, list) else None
