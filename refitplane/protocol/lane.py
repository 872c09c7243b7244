"""The control lane's framing, shared by the coordinator and agents (docs/coordinator.md,
"The control lane"): a TCP connection beside gRPC carrying one member's commands and
reports as `refit.v1.LaneFrame` messages, each behind a 4-byte big-endian length.

Why a lane beside gRPC: every refit phase waits on a command going out and reports coming
back, and gRPC-Python spends ~0.3-0.45 ms of threads and HTTP/2 on each such message where
the lane spends about half (`benchmarks/report_hops.py` prints both floors). The messages
are the proto's own, so the wire vocabulary stays in `proto/`; only their envelope differs.
"""

from __future__ import annotations

import struct

from google.protobuf.message import DecodeError

from refitplane import errors
from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.protocol.channel import MAX_MESSAGE_BYTES, MAX_STREAM_REPORT_BYTES, error_for

HEADER = struct.Struct("!I")
# What an agent may send in one frame: a hello, or a report small enough for a stream
# (larger ones go by the unary Report), with room for the frame's own fields.
MAX_AGENT_FRAME_BYTES = MAX_STREAM_REPORT_BYTES + 64
# What the coordinator may send: a command, as large as gRPC would carry it (a plan's body).
MAX_COORDINATOR_FRAME_BYTES = MAX_MESSAGE_BYTES
# A connection that has not said who it is within this long is closed.
HELLO_TIMEOUT_S = 5.0
# Writes to a peer that stopped reading give up after this long (the lane closes).
WRITE_TIMEOUT_S = 30.0


def encode(frame: apb.LaneFrame) -> bytes:
    body = frame.SerializeToString()
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes, limit: int, sender: str) -> int:
    """The length a frame's header announces, refused above `limit` before a byte of the
    body is read."""
    length = int(HEADER.unpack(header)[0])
    if length > limit:
        raise errors.InvalidArgument(
            f"a control lane frame from the {sender} announces {length} bytes, above its "
            f"limit of {limit}",
            field="frame",
        )
    return length


def decode(body: bytes, sender: str) -> apb.LaneFrame:
    frame = apb.LaneFrame()
    try:
        frame.ParseFromString(body)
    except (DecodeError, ValueError):  # the bytes are not a LaneFrame
        raise errors.InvalidArgument(
            f"a control lane frame from the {sender} is not a refit.v1.LaneFrame",
            field="frame",
        ) from None
    if frame.WhichOneof("frame") is None:
        raise errors.InvalidArgument(
            f"a control lane frame from the {sender} carries nothing", field="frame"
        )
    return frame


def error_frame(exc: errors.RefitError, seq: int = 0) -> apb.LaneFrame:
    return apb.LaneFrame(
        error=apb.LaneError(seq=seq, reason=exc.reason, message=exc.message, field=exc.field or "")
    )


def error_of(frame: apb.LaneError) -> errors.RefitError:
    """The domain error a LaneError stands for, as a failed gRPC call's would be."""
    return error_for(frame.reason, frame.message, frame.field or None)
