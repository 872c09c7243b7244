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
* `ProbeServer` (the standard library's `ThreadingHTTPServer` on REFIT_PROBE_PORT with
  the project's `JsonRequestHandler`, no TLS: it carries no data) answers `GET /healthz`
  200 while the loop ticked within `stall_s`, else 503 naming how long it has been stuck;
  `GET /readyz` 200 only while the loop is live and the last store check, at most
  `stale_s` old, passed; else 503 with the reason.

A probe sends one short request, so each connection is bounded as a whole: at most
`_MAX_REQUEST_BYTES` (more is answered 431) and `_CLIENT_TIMEOUT_S` from its accept to the
end of its head (a slow-loris client is dropped unanswered then, however often it sends a
byte). Each connection has a thread of its own, so a slow one never delays another probe,
and lives at most that long. The port is for the kubelet, not for the Service.
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING

from refitplane.errors import RefitError
from refitplane.http_json import JsonRequestHandler

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

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


class _BoundedRequest(io.RawIOBase):
    """A probe connection's bytes as the handler reads them, within one deadline and one
    size cap for the whole request: a client that trickles a byte at a time (slow loris)
    is cut off at the deadline however often it sends (a per-read timeout would not), and
    one that sends more than the cap reads as ended there (`exhausted`)."""

    def __init__(self, sock: socket.socket, *, deadline: float, limit: int) -> None:
        self._sock = sock
        self._deadline = deadline
        self._left = limit
        self.exhausted = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        if self._left <= 0:
            self.exhausted = True
            return 0
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            # BaseHTTPRequestHandler drops the connection on a TimeoutError, unanswered.
            raise TimeoutError(f"no whole request within {_CLIENT_TIMEOUT_S:g} s")
        self._sock.settimeout(remaining)
        received = self._sock.recv_into(memoryview(buffer).cast("B")[: self._left])
        self._left -= received
        return received


class _ProbeHandler(JsonRequestHandler):
    """GET (or HEAD) /healthz and /readyz, one request per connection (HTTP/1.0)."""

    log_name = "probes"
    log = log
    # The socket's timeout until the first read; reads then get what is left of the
    # request's deadline, and the answer (a few hundred bytes) this again (`do_GET`).
    timeout = _CLIENT_TIMEOUT_S
    probes: ProbeServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # read through the bounds instead
        self.request_bytes = _BoundedRequest(
            self.connection,
            deadline=time.monotonic() + _CLIENT_TIMEOUT_S,
            limit=_MAX_REQUEST_BYTES,
        )
        self.rfile = io.BufferedReader(self.request_bytes)

    def do_GET(self) -> None:
        self.connection.settimeout(_CLIENT_TIMEOUT_S)
        if self.request_bytes.exhausted:
            message = f"a probe request has at most {_MAX_REQUEST_BYTES} bytes"
            self._reply(431, {"status": "too large", "message": message})
            return
        self._reply(*self.probes.answer(self.path))

    do_HEAD = do_GET


class _ProbeHttpServer(ThreadingHTTPServer):
    request_queue_size = 64

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that went away mid-answer is no error of the coordinator's.
        log.debug("probe connection from %s failed", client_address, exc_info=True)


class _ProbeHttpServer6(_ProbeHttpServer):
    address_family = socket.AF_INET6


class ProbeServer:
    """`/healthz` and `/readyz` from `heartbeat`, served from a thread of its own."""

    def __init__(self, heartbeat: LoopHeartbeat, *, stall_s: float, stale_s: float) -> None:
        self.heartbeat = heartbeat
        self.stall_s = stall_s
        self.stale_s = stale_s
        self.port = 0
        self._http: _ProbeHttpServer | None = None
        self._thread: threading.Thread | None = None

    def bind(self, host: str, port: int) -> int:
        server_class = _ProbeHttpServer6 if ":" in host else _ProbeHttpServer
        handler = type("ProbeHandler", (_ProbeHandler,), {"probes": self})
        self._http = server_class((host, port), handler)
        self.port = self._http.server_address[1]
        return self.port

    def start(self) -> None:
        if self._http is None:
            raise RuntimeError("ProbeServer.bind() first")
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="probes",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        if self._http is None:
            return
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=2.0)
        self._http.server_close()
        self._http = None
        self._thread = None

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

    def answer(self, target: str) -> tuple[int, dict[str, object]]:
        """The answer to a GET of `target` (a path, with or without a query)."""
        path = target.split("?", 1)[0]
        if path == "/healthz":
            return self.liveness()
        if path == "/readyz":
            return self.readiness()
        return 404, {"status": "not found", "message": f"no route {path}"}
