"""Liveness and readiness on their own port and thread, fast under any load and still true.

The REST port's `/healthz` shares the event loop with the parsing of every request: under a
burst of 1,000 connections one loop iteration takes hundreds of milliseconds on two busy
cores, and a probe waits behind them (p99 0.27 to 2.4 s, benchmarks/admission.py). A probe on
its own thread answers at once, but would also answer while the loop is wedged; so it
answers from what the loop proves:

* `LoopHeartbeat` (a task on the coordinator's loop) stamps the time every `tick_s`, and
  every `store_check_s` checks the store as `/readyz` on the REST port does (a ping, and the
  incarnation sentinel of `core/lost_state.py`: not ready while a store that lost its state
  is re-seeded), recording the outcome.
* `ProbeServer` (a plain HTTP/1.1 listener on REFIT_PROBE_PORT, one thread, no TLS: it
  carries no data) answers `GET /healthz` 200 while the loop ticked within `stall_s`, else
  503 naming how long it has been stuck; `GET /readyz` 200 only while the loop is live and
  the last store check, at most `stale_s` old, passed; else 503 with the reason.

Connections are served one at a time, each bounded by `_CLIENT_TIMEOUT_S` (a probe sends
one short request); the port is for the kubelet, not for the Service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from refitplane.errors import RefitError

log = logging.getLogger(__name__)

_CLIENT_TIMEOUT_S = 1.0
_MAX_REQUEST_BYTES = 4096


@dataclass(frozen=True)
class StoreCheck:
    ok: bool
    message: str
    at: float  # time.monotonic() of the check's end


class LoopHeartbeat:
    """Runs on the coordinator's loop; read from the probe thread (plain attribute reads)."""

    def __init__(
        self,
        check_store: Callable[[], Awaitable[None]],
        *,
        tick_s: float = 0.05,
        store_check_s: float = 1.0,
        store_timeout_s: float = 5.0,
    ) -> None:
        self._check_store = check_store
        self.tick_s = tick_s
        self.store_check_s = store_check_s
        self.store_timeout_s = store_timeout_s
        self.last_tick = time.monotonic()
        self.store = StoreCheck(False, "the state store was not checked yet", 0.0)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.last_tick = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._tick(), name="probe-heartbeat"),
            asyncio.create_task(self._watch_store(), name="probe-store-check"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _tick(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(self.tick_s)

    async def _watch_store(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._check_store(), self.store_timeout_s)
                self.store = StoreCheck(True, "", time.monotonic())
            except TimeoutError:
                message = f"the state store did not answer within {self.store_timeout_s:g} s"
                self.store = StoreCheck(False, message, time.monotonic())
            except RefitError as exc:
                self.store = StoreCheck(False, exc.message, time.monotonic())
            except Exception as exc:  # the watch must outlive any one check
                log.exception("store check failed")
                self.store = StoreCheck(False, f"{type(exc).__name__}: {exc}", time.monotonic())
            await asyncio.sleep(self.store_check_s)


class ProbeServer:
    """`/healthz` and `/readyz` from `heartbeat`, on a listener thread of its own."""

    def __init__(self, heartbeat: LoopHeartbeat, *, stall_s: float, stale_s: float) -> None:
        self.heartbeat = heartbeat
        self.stall_s = stall_s
        self.stale_s = stale_s
        self.port = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def bind(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        sock.settimeout(0.5)  # so that stop() is noticed
        self._sock = sock
        self.port = sock.getsockname()[1]
        return self.port

    def start(self) -> None:
        assert self._sock is not None, "bind() first"
        self._thread = threading.Thread(target=self._serve, name="probes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()

    # -- the answers ------------------------------------------------------------------------

    def liveness(self) -> tuple[int, dict[str, object]]:
        stalled = time.monotonic() - self.heartbeat.last_tick
        if stalled > self.stall_s:
            message = f"the event loop has not run for {stalled:.1f} s (bound {self.stall_s:g} s)"
            return 503, {"status": "stalled", "message": message}
        return 200, {"status": "ok"}

    def readiness(self) -> tuple[int, dict[str, object]]:
        status, body = self.liveness()
        if status != 200:
            return status, body
        check = self.heartbeat.store
        age = time.monotonic() - check.at
        if not check.ok:
            return 503, {"status": "not ready", "message": check.message}
        if age > self.stale_s:
            message = f"the state store was last checked {age:.1f} s ago (bound {self.stale_s:g} s)"
            return 503, {"status": "not ready", "message": message}
        return 200, {"status": "ready"}

    def answer(self, request_line: str) -> tuple[int, dict[str, object]]:
        parts = request_line.split()
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            return 400, {"status": "bad request", "message": "GET /healthz or /readyz"}
        path = parts[1].split("?", 1)[0]
        if path == "/healthz":
            return self.liveness()
        if path == "/readyz":
            return self.readiness()
        return 404, {"status": "not found", "message": f"no route {path}"}

    # -- the listener -----------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: do not spin
                continue
            with conn:
                try:
                    self._handle(conn)
                except OSError:
                    pass  # the client went away or was too slow: nothing to answer

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(_CLIENT_TIMEOUT_S)
        deadline = time.monotonic() + _CLIENT_TIMEOUT_S
        data = b""
        # The whole head (a probe sends no body): closing with unread bytes would reset the
        # connection, and the client could lose the answer.
        while b"\r\n\r\n" not in data and len(data) < _MAX_REQUEST_BYTES:
            if time.monotonic() > deadline:
                return
            chunk = conn.recv(_MAX_REQUEST_BYTES)
            if not chunk:
                return
            data += chunk
        line = data.split(b"\r\n", 1)[0].decode("latin-1")
        status, body = self.answer(line)
        payload = json.dumps(body).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}
        head = (
            f"HTTP/1.1 {status} {reason[status]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode()
        conn.sendall(head if line.startswith("HEAD ") else head + payload)
