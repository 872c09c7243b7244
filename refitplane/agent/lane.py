"""`ControlLane`: an agent's end of the coordinator's control lane (docs/coordinator.md, "The
control lane"): one TCP connection (TLS when the coordinator's gRPC has it) carrying this
member's commands in and its reports out, beside gRPC.

The lane runs on a small asyncio loop of its own (TLS without sharing an SSL object between
threads): `open` connects and says hello as the member, and each command goes to the
session as StreamCommands would deliver it. Reports come from any thread (`send`), written
through that loop and answered in order. Like the report stream, the lane is an
optimisation, never a dependency: `send` answers None whenever it cannot carry a report
(closed, slow, too large), `open` answers False when it cannot connect, and the session then
uses StreamCommands, StreamReports or Report — and opens the lane again while on gRPC: the
coordinator hands the member's commands to the newest stream, so the gRPC one ends cleanly
after what it already carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.errors import RefitError
from refitplane.protocol import lane as wire
from refitplane.reasons import Reason

log = logging.getLogger(__name__)

_SENDER = "coordinator"
# How long a connection attempt may take before the session falls back to gRPC.
CONNECT_TIMEOUT_S = 2.0
# After a failed connection the lane is not tried again for this long (gRPC carries on).
RETRY_AFTER_S = 5.0
# Answers after which the report goes by gRPC instead (the coordinator could not take it
# here; the unary path retries on its own).
_FALL_BACK = frozenset({Reason.UNAVAILABLE, Reason.RATE_LIMITED, Reason.INTERNAL})


def lane_host(target: str) -> str | None:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port"), where the
    lane listens too; None for targets with no TCP host (unix sockets)."""
    target = target.removeprefix("dns:///").removeprefix("dns:")
    if target.startswith(("unix:", "unix-abstract:", "vsock:")):
        return None
    host, sep, _ = target.rpartition(":")
    if not sep or not host:
        return None
    return host.strip("[]")


class ControlLane:
    def __init__(
        self,
        target: str,
        *,
        tls_ca: str | Path | None,
        token: str | None,
        timeout_s: float,
        enabled: bool,
        lane_target: str = "",
    ) -> None:
        """`target`: the gRPC target, whose host the lane is dialled on at `port` (the
        coordinator's RegisterResponse); `lane_target` ("host:port") overrides both."""
        self._host = lane_host(lane_target or target)
        self._fixed_port = _port_of(lane_target) if lane_target else 0
        self._tls: ssl.SSLContext | None = None
        if tls_ca is not None:
            self._tls = ssl.create_default_context(cafile=str(tls_ca))
        self._token = token or ""
        self._timeout = timeout_s
        self.enabled = enabled and self._host is not None
        # The coordinator's lane port, from its last RegisterResponse (0: it has none).
        self.port = 0
        self._retry_at = 0.0
        self._unreachable = False  # the last attempt failed (said once, at WARNING)
        self._opening = threading.Lock()
        self._lock = threading.Lock()  # one report in flight, as on a report stream
        self._answers: queue.Queue[apb.LaneFrame | None] = queue.Queue()
        self._seq = 0
        # The loop every lane of this agent runs on (started with the first one).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # While open: the member it speaks for and its writer; `closed` is set when it ends,
        # `refusal` says why when the coordinator refused it.
        self._member_id = ""
        self._writer: asyncio.StreamWriter | None = None
        self.closed = threading.Event()
        self.closed.set()
        self.refusal: RefitError | None = None
        # Lanes opened, and reports the lane carried.
        self.opened = 0
        self.sent = 0

    @property
    def offered(self) -> bool:
        """On here, and the coordinator has a lane (its last RegisterResponse named one)."""
        return self.enabled and self._port() > 0

    def usable(self) -> bool:
        """Offered, and not within RETRY_AFTER_S of a failed attempt."""
        return self.offered and time.monotonic() >= self._retry_at

    def _port(self) -> int:
        """Where the lane is dialled: REFIT_LANE_TARGET's port, else the coordinator's.
        Only a coordinator that has a lane (a port in its RegisterResponse) is dialled."""
        return (self._fixed_port or self.port) if self.port else 0

    def is_open(self, member_id: str) -> bool:
        return not self.closed.is_set() and self._member_id == member_id

    # --- opening and closing -----------------------------------------------------------------

    def open(
        self, member_id: str, credential: str, on_command: Callable[[apb.Command], None]
    ) -> bool:
        """Open the lane as `member_id` (True when it is open, also when it already was);
        its commands go to `on_command` on the lane's own thread until it closes (`closed`).
        False when it cannot be reached: gRPC carries on, and the lane is not tried again
        for RETRY_AFTER_S."""
        with self._opening:
            if self.is_open(member_id):
                return True
            self.close()
            if not self.closed.wait(self._timeout):
                return False  # the last lane did not end: try later
            loop = self._start_loop()
            connect = self._connect(member_id, credential, on_command)
            try:
                asyncio.run_coroutine_threadsafe(connect, loop).result(CONNECT_TIMEOUT_S + 1)
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                self._retry_at = time.monotonic() + RETRY_AFTER_S
                # Once per outage: the session tries again every RETRY_AFTER_S meanwhile.
                log.log(
                    logging.DEBUG if self._unreachable else logging.WARNING,
                    "control lane at %s:%d unreachable (%s): commands and reports go over gRPC",
                    self._host,
                    self._port(),
                    exc or type(exc).__name__,
                )
                self._unreachable = True
                return False
            if self._unreachable:
                log.info("control lane at %s:%d open again", self._host, self._port())
                self._unreachable = False
            self.opened += 1
            return True

    def reopen_while(
        self,
        member_id: str,
        credential: str,
        on_command: Callable[[apb.Command], None],
        *,
        carrying: Callable[[], bool],
        stop: threading.Event,
    ) -> None:
        """While StreamCommands carries the commands (`carrying()`), try the lane every
        RETRY_AFTER_S: once it opens, the coordinator ends that stream after what it already
        carried (the newest stream of a member takes its commands) and the session holds
        the lane."""
        while not stop.wait(RETRY_AFTER_S) and carrying():
            if self.usable() and self.open(member_id, credential, on_command):
                return

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name="refit-agent-lane", daemon=True
            )
            self._thread.start()
            self._loop = loop
        return self._loop

    async def _connect(
        self, member_id: str, credential: str, on_command: Callable[[apb.Command], None]
    ) -> None:
        assert self._host is not None
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(
                self._host, self._port(), ssl=self._tls, limit=2**20
            )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)
        hello = apb.LaneHello(member_id=member_id, token=self._token, member_credential=credential)
        writer.write(wire.encode(apb.LaneFrame(hello=hello)))
        while not self._answers.empty():  # what the last lane left (its closing None)
            self._answers.get_nowait()
        self._member_id, self._writer, self.refusal = member_id, writer, None
        self.closed.clear()
        asyncio.get_running_loop().create_task(self._read(reader, writer, on_command))

    async def _read(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_command: Callable[[apb.Command], None],
    ) -> None:
        try:
            while True:
                header = await reader.readexactly(wire.HEADER.size)
                length = wire.frame_length(header, wire.MAX_COORDINATOR_FRAME_BYTES, _SENDER)
                frame = wire.decode(await reader.readexactly(length), _SENDER)
                kind = frame.WhichOneof("frame")
                if kind == "command":
                    on_command(frame.command)
                elif kind == "answer" or (kind == "error" and frame.error.seq):
                    self._answers.put(frame)
                elif kind == "error":  # the lane itself was refused
                    self.refusal = wire.error_of(frame.error)
                    log.warning("control lane refused: %s", self.refusal.message)
                    return
        except asyncio.IncompleteReadError:
            pass  # closed (by the coordinator, or by `close`)
        except (ConnectionError, ssl.SSLError, RefitError) as exc:
            log.info("control lane closed: %s", exc or type(exc).__name__)
        except Exception:
            log.exception("control lane failed")
        finally:
            self._member_id, self._writer = "", None
            self._answers.put(None)  # a report waiting for its answer falls back
            writer.close()
            self.closed.set()

    def close(self) -> None:
        """End the open lane (a new registration, the session closing)."""
        loop, writer = self._loop, self._writer
        if loop is not None and writer is not None:
            with contextlib.suppress(RuntimeError):  # its loop already stopped
                loop.call_soon_threadsafe(writer.close)

    def shutdown(self) -> None:
        """Close the lane and stop its thread (the session is closing)."""
        self.close()
        self.closed.wait(1.0)
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=2.0)
            if not thread.is_alive():
                loop.close()
        self._loop = None

    # --- reports, from any thread ------------------------------------------------------------

    def send(self, member_id: str, request: apb.ReportRequest) -> bool | None:
        """Whether the coordinator accepted the report; None: the lane did not carry it
        (send it by gRPC). Raises the coordinator's answer to the report itself (NotFound,
        PermissionDenied, InvalidArgument, ...), as the unary call would."""
        if not self.is_open(member_id):
            return None
        frame = apb.LaneFrame(report=apb.StreamReportsRequest(report=request))
        if not self._lock.acquire(timeout=self._timeout):
            return None
        try:
            loop, writer = self._loop, self._writer
            if loop is None or writer is None or not self.is_open(member_id):
                return None
            self._seq += 1
            seq = frame.report.seq = self._seq
            data = wire.encode(frame)
            if len(data) - wire.HEADER.size > wire.MAX_AGENT_FRAME_BYTES:
                return None  # the unary Report takes it
            try:
                loop.call_soon_threadsafe(writer.write, data)
            except RuntimeError:  # the loop stopped under us
                return None
            return self._answer(seq)
        finally:
            self._lock.release()

    def _answer(self, seq: int) -> bool | None:
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                log.info("control lane: no answer within %.1f s; closing it", self._timeout)
                self.close()
                return None
            if answer is None:  # the lane closed
                return None
            kind = answer.WhichOneof("frame")
            got = answer.answer.seq if kind == "answer" else answer.error.seq
            if got < seq:
                continue  # the answer to a report that already fell back
            if kind == "answer":
                self.sent += 1
                return bool(answer.answer.accepted)
            error = wire.error_of(answer.error)
            if error.reason in _FALL_BACK:
                return None
            raise error


def _port_of(target: str) -> int:
    _, _, port = target.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"REFIT_LANE_TARGET {target!r} is not host:port")
    return int(port)


def _keepalive(sock: socket.socket) -> None:
    """Notice a coordinator host that vanished without closing within ~25 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
