"""The control lane's server (docs/coordinator.md, "The control lane"): one TCP connection
per agent beside gRPC, on the coordinator's event loop, carrying that member's commands out
and its reports in as `refit.v1.LaneFrame`s (`refitplane.protocol.lane`).

A connection proves who it is in its first frame, as gRPC metadata would (the shared token
when one is set, the member's own credential), within `HELLO_TIMEOUT_S`; it then gets the
member's command stream, which replaces any other stream of that member (the outbox's rule),
and each report it sends is handled as StreamReports handles one and answered in order.
Every frame's length is checked before its body is read, and the lanes are counted: a
caller who is no member holds a connection for at most the hello's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.core.service import Coordinator
from refitplane.coordinator.grpc.encoding import CommandEncoder
from refitplane.errors import InvalidArgument, PermissionDenied, RateLimited, RefitError
from refitplane.protocol import convert
from refitplane.protocol import lane as wire

log = logging.getLogger(__name__)

_SENDER = "agent"
# Connections held at once, hellos included (members of every job, with room to reconnect).
MAX_LANES = 8192


class LaneServer:
    def __init__(
        self,
        core: Coordinator,
        tokens: TokenCheck,
        *,
        tls: ssl.SSLContext | None = None,
        hello_timeout_s: float = wire.HELLO_TIMEOUT_S,
        max_lanes: int = MAX_LANES,
    ) -> None:
        self._core = core
        self._tokens = tokens
        self._tls = tls
        self._hello_timeout_s = hello_timeout_s
        self._max_lanes = max_lanes
        self._encoder = CommandEncoder()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (OSError when it cannot)."""
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=self._tls, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop accepting and close every lane (agents fall back to gRPC or reconnect)."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._server.wait_closed()
        self._server = None

    # --- one connection ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        metrics = self._core.metrics
        if len(self._writers) >= self._max_lanes:
            await _refuse(writer, RateLimited(f"{self._max_lanes} control lanes are open"))
            return
        self._writers.add(writer)
        pump: asyncio.Task[None] | None = None
        member_id = ""
        try:
            async with asyncio.timeout(self._hello_timeout_s):
                first = await _read(reader)
            member_id, credential = self._hello(first)
            metrics.lanes.inc()
            pump = asyncio.create_task(self._pump(member_id, credential, writer), name="lane")
            await self._reports(reader, writer, member_id, credential, pump.done)
        except RefitError as exc:
            metrics.lane_refusals.labels(exc.reason).inc()
            await _refuse(writer, exc)
        except TimeoutError:
            metrics.lane_refusals.labels("HELLO_TIMEOUT").inc()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass  # the agent went away (or never spoke TLS): nothing to answer
        except Exception:
            log.exception("control lane of member %r failed", member_id)
        finally:
            if pump is not None:
                metrics.lanes.dec()
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump
            self._writers.discard(writer)
            writer.close()

    def _hello(self, frame: apb.LaneFrame) -> tuple[str, str]:
        if frame.WhichOneof("frame") != "hello":
            raise InvalidArgument(
                "a control lane's first frame must be its hello", field="frame.hello"
            )
        hello = frame.hello
        self._tokens.check(f"Bearer {hello.token}" if hello.token else None)
        member = self._core.member(hello.member_id, credential=hello.member_credential)
        return member.member_id, hello.member_credential

    async def _pump(self, member_id: str, credential: str, writer: asyncio.StreamWriter) -> None:
        """The member's commands, in order, until its stream ends (the member gone, a newer
        stream, shutdown); then the lane closes and the agent reconnects."""
        try:
            async for command in self._core.stream(member_id, credential=credential):
                writer.write(wire.encode(apb.LaneFrame(command=self._encoder.encode(command))))
                async with asyncio.timeout(wire.WRITE_TIMEOUT_S):
                    await writer.drain()
        finally:
            writer.close()

    async def _reports(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        member_id: str,
        credential: str,
        pump_done: Callable[[], bool],
    ) -> None:
        """Each report handled as it arrives and answered by its seq; a report's own error
        (NOT_FOUND, INVALID_ARGUMENT, ...) answers it and the lane goes on, anything that
        breaks the lane's rules ends it."""
        while not pump_done():
            frame = await _read(reader)
            if frame.WhichOneof("frame") != "report":
                raise InvalidArgument(
                    "after its hello a control lane carries only reports", field="frame"
                )
            request = frame.report
            if request.report.member_id != member_id:
                raise PermissionDenied(
                    f"this lane reports for member {member_id!r}, not {request.report.member_id!r}",
                    field="report.member_id",
                )
            try:
                report = convert.report_from_proto(request.report)
                accepted = await self._core.report(report, credential=credential)
            except RefitError as exc:
                writer.write(wire.encode(wire.error_frame(exc, request.seq)))
            else:
                self._core.metrics.reports.labels("LANE").inc()
                answer = apb.StreamReportsResponse(seq=request.seq, accepted=accepted)
                writer.write(wire.encode(apb.LaneFrame(answer=answer)))
            async with asyncio.timeout(wire.WRITE_TIMEOUT_S):
                await writer.drain()


async def _read(reader: asyncio.StreamReader) -> apb.LaneFrame:
    header = await reader.readexactly(wire.HEADER.size)
    length = wire.frame_length(header, wire.MAX_AGENT_FRAME_BYTES, _SENDER)
    return wire.decode(await reader.readexactly(length), _SENDER)


async def _refuse(writer: asyncio.StreamWriter, exc: RefitError) -> None:
    """Say why the lane ends (best effort: the peer may be gone) and close it."""
    with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError):
        writer.write(wire.encode(wire.error_frame(exc)))
        async with asyncio.timeout(1.0):
            await writer.drain()
    writer.close()
