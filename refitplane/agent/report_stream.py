"""`ReportStream`: a member's reports on one StreamReports stream it holds open (issue 23).

A unary Report is a new HTTP/2 stream per report, and the coordinator's event loop runs a
whole call (headers, interceptor, status) for each; two ranks' TransferDone reports sent
together were handled 1-2 ms apart. Here each report is one message on a stream opened
once per member id, answered in order (`seq` echoed). One report is in flight per stream;
every wait is bounded by the session's timeout.

The stream is an optimisation, never a dependency: `send` answers None whenever it cannot
carry a report (turned off with REFIT_REPORT_STREAM=0, a report above
MAX_STREAM_REPORT_BYTES, the stream broken or slow, a coordinator without StreamReports)
and the session sends that report by the unary Report instead. A broken stream is opened
again for a later report after RETRY_AFTER_S; a coordinator that answers UNIMPLEMENTED is
not asked again. Errors the coordinator answers for the report itself (NOT_FOUND for a
member it lost, PERMISSION_DENIED, INVALID_ARGUMENT) are raised as the unary call would.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane.errors import RefitError
from refitplane.protocol.channel import (
    MAX_STREAM_REPORT_BYTES,
    Metadata,
    from_rpc_error,
    status_code,
)

log = logging.getLogger(__name__)

# A broken stream is not reopened for this long: the reports in between go unary.
RETRY_AFTER_S = 1.0
# Codes after which the report is sent again by the unary path (which retries on its own).
_FALL_BACK = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
_END = None  # what ends the request iterator
# What wrapping a report in a StreamReportsRequest adds at most (the report's tag and a
# length of up to 3 bytes, seq's tag and a varint of up to 10): the coordinator measures
# the wrapped request against MAX_STREAM_REPORT_BYTES, so the stream takes a report only
# where that fits.
_WRAPPING_BYTES = 1 + 3 + 1 + 10


class _Broken(Exception):
    def __init__(self, code: grpc.StatusCode, error: RefitError | None = None) -> None:
        super().__init__(code.name)
        self.code = code
        self.error = error


class _Open:
    """One open stream for one member id: grpc's own thread writes what `requests` yields, a
    reader thread of ours hands each answer (or the stream's end) to `answers`."""

    def __init__(
        self, stub: agent_pb2_grpc.AgentServiceStub, member_id: str, meta: Metadata
    ) -> None:
        self.member_id = member_id
        self._requests: queue.Queue[apb.StreamReportsRequest | None] = queue.Queue()
        self._answers: queue.Queue[apb.StreamReportsResponse | grpc.RpcError | None] = queue.Queue()
        self._seq = 0
        self._call: Any = stub.StreamReports(self._outgoing(), metadata=meta)
        self._reader = threading.Thread(target=self._read, name="refit-agent-reports", daemon=True)
        self._reader.start()

    def _outgoing(self) -> Iterator[apb.StreamReportsRequest]:
        return iter(self._requests.get, _END)

    def _read(self) -> None:
        try:
            for answer in self._call:
                self._answers.put(answer)
        except grpc.RpcError as exc:
            self._answers.put(exc)
        finally:
            self._answers.put(None)

    def exchange(self, request: apb.ReportRequest, timeout_s: float) -> bool:
        self._seq += 1
        self._requests.put(apb.StreamReportsRequest(report=request, seq=self._seq))
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise _Broken(grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if answer is None:  # the coordinator ended the stream (shutting down)
            raise _Broken(grpc.StatusCode.UNAVAILABLE)
        if isinstance(answer, grpc.RpcError):
            code = status_code(answer)
            raise _Broken(code, None if code in _FALL_BACK else from_rpc_error(answer))
        if answer.seq != self._seq:
            raise _Broken(grpc.StatusCode.INTERNAL)
        return bool(answer.accepted)

    def close(self) -> None:
        self._requests.put(_END)
        self._call.cancel()


class ReportStream:
    def __init__(
        self, stub: agent_pb2_grpc.AgentServiceStub, *, timeout_s: float, enabled: bool
    ) -> None:
        self._stub = stub
        self._timeout = timeout_s
        self.enabled = enabled
        self._lock = threading.Lock()
        self._open: _Open | None = None
        self._retry_at = 0.0
        # Reports carried by the stream, and those it handed back to the unary path.
        self.sent = 0
        self.fell_back = 0

    def send(self, member_id: str, metadata: Metadata, request: apb.ReportRequest) -> bool | None:
        """Whether the coordinator accepted the report; None: the stream did not carry it
        (send it by the unary Report). Raises the coordinator's answer to the report itself
        (NotFound, PermissionDenied, ...), as the unary call would."""
        if not self.enabled or request.ByteSize() + _WRAPPING_BYTES > MAX_STREAM_REPORT_BYTES:
            return None
        # Another thread's report in flight: wait for it, bounded (answers come in order).
        if not self._lock.acquire(timeout=self._timeout):
            self.fell_back += 1
            return None
        try:
            if time.monotonic() < self._retry_at:
                self.fell_back += 1
                return None
            stream = self._open
            if stream is None or stream.member_id != member_id:  # a new registration
                if stream is not None:
                    stream.close()
                stream = self._open = _Open(self._stub, member_id, metadata)
            try:
                accepted = stream.exchange(request, self._timeout)
            except _Broken as broken:
                return self._broken(stream, broken)
            self.sent += 1
            return accepted
        finally:
            self._lock.release()

    def _broken(self, stream: _Open, broken: _Broken) -> bool | None:
        stream.close()
        self._open = None
        if broken.error is not None:
            raise broken.error  # the coordinator's answer to this report
        if broken.code == grpc.StatusCode.UNIMPLEMENTED:
            log.info("the coordinator has no StreamReports: reports go unary")
            self.enabled = False
        else:
            log.info("report stream broke (%s): unary for %.1f s", broken.code.name, RETRY_AFTER_S)
            self._retry_at = time.monotonic() + RETRY_AFTER_S
        self.fell_back += 1
        return None

    def close(self) -> None:
        """End the stream; a report in flight on it falls back (its wait ends at once)."""
        stream = self._open
        if stream is not None:
            stream.close()
        if self._lock.acquire(timeout=self._timeout):
            self._open = None
            self._lock.release()
