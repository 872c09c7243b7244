"""refit.v1.AgentService over the core: convert, call, convert back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.coordinator.core.service import Coordinator
from refitplane.coordinator.grpc.encoding import CommandEncoder
from refitplane.coordinator.grpc.layout_uploads import LayoutUploads
from refitplane.errors import InvalidArgument, PermissionDenied
from refitplane.protocol import convert
from refitplane.protocol.channel import MAX_STREAM_REPORT_BYTES, MEMBER_CREDENTIAL_KEY
from refitplane.reshard.layout import Layout

Context = grpc.aio.ServicerContext[Any, Any]


def _convert(layout: cpb.RankLayout, rank: int, max_boxes_per_tensor: int) -> Layout:
    """Validate a published layout and hash it: in a worker thread, so a layout of 10^5
    boxes never holds up the event loop (leases, `/healthz`)."""
    converted = convert.layout_from_proto(layout, rank, max_boxes_per_tensor=max_boxes_per_tensor)
    _ = converted.digest  # memoized on the layout
    return converted


def _credential(context: Context) -> str:
    """The member credential the caller presented ('' when none)."""
    value = dict(context.invocation_metadata() or ()).get(MEMBER_CREDENTIAL_KEY, "")
    return value if isinstance(value, str) else ""


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, core: Coordinator, *, lane_port: Callable[[], int] = lambda: 0) -> None:
        """`lane_port`: the control lane's bound port once serving (0: none)."""
        self._core = core
        self._lane_port = lane_port
        self._encoder = CommandEncoder()
        self._uploads = LayoutUploads(max_bytes=core.settings.max_layout_bytes)

    async def Register(
        self, request: apb.RegisterRequest, context: Context
    ) -> apb.RegisterResponse:
        member, credential = await self._core.register(convert.register_from_proto(request))
        ttl = self._core.settings.lease_ttl_s
        return apb.RegisterResponse(
            member_id=member.member_id,
            lease_ttl_s=ttl,
            renew_interval_s=ttl / 3,
            member_credential=credential,
            lane_port=self._lane_port(),
        )

    async def RenewLease(
        self, request: apb.RenewLeaseRequest, context: Context
    ) -> apb.RenewLeaseResponse:
        held = (request.held.version, request.held.serving) if request.HasField("held") else None
        member = await self._core.renew(
            request.member_id, credential=_credential(context), held=held
        )
        return apb.RenewLeaseResponse(
            lease_expires_unix=member.lease_expires_unix,
            state=convert.member_state_to_proto(member.state),
        )

    async def PublishLayout(
        self, request: apb.PublishLayoutRequest, context: Context
    ) -> apb.PublishLayoutResponse:
        credential = _credential(context)
        member = self._core.member(request.member_id, credential=credential)
        whole = self._uploads.add(request)
        if whole is None:  # a chunk; more to come
            return apb.PublishLayoutResponse(num_tensors=self._uploads.received(member.member_id))
        layout = await asyncio.to_thread(
            _convert, whole, member.rank, self._core.settings.max_boxes_per_tensor
        )
        await self._core.publish_layout(member.member_id, layout, credential=credential)
        return apb.PublishLayoutResponse(layout_digest=layout.digest, num_tensors=len(layout))

    async def StreamCommands(
        self, request: apb.StreamCommandsRequest, context: Context
    ) -> AsyncIterator[apb.Command]:
        async for command in self._core.stream(request.member_id, credential=_credential(context)):
            yield self._encoder.encode(command)

    async def Report(self, request: apb.ReportRequest, context: Context) -> apb.ReportResponse:
        accepted = await self._core.report(
            convert.report_from_proto(request), credential=_credential(context)
        )
        self._core.metrics.reports.labels("UNARY").inc()
        return apb.ReportResponse(accepted=accepted)

    async def StreamReports(
        self, requests: AsyncIterator[apb.StreamReportsRequest], context: Context
    ) -> AsyncIterator[apb.StreamReportsResponse]:
        """Reports on one open stream, each handled as it arrives. The credential came with
        the stream's metadata; the first report binds the stream to its member (checked
        then, and again with every report: a member replaced or gone is refused as on the
        unary path), and a report naming another member ends the stream."""
        credential = _credential(context)
        bound = ""
        async for request in requests:
            report = request.report
            if request.ByteSize() > MAX_STREAM_REPORT_BYTES:
                raise InvalidArgument(
                    f"a streamed report is {request.ByteSize()} bytes, above "
                    f"{MAX_STREAM_REPORT_BYTES} (send it with Report)",
                    field="report",
                )
            if not bound:
                bound = self._core.authenticate(report.member_id, credential).member_id
            elif report.member_id != bound:
                raise PermissionDenied(
                    f"this stream reports for member {bound!r}, not {report.member_id!r}",
                    field="report.member_id",
                )
            accepted = await self._core.report(
                convert.report_from_proto(report), credential=credential
            )
            self._core.metrics.reports.labels("STREAM").inc()
            yield apb.StreamReportsResponse(seq=request.seq, accepted=accepted)

    async def Deregister(
        self, request: apb.DeregisterRequest, context: Context
    ) -> apb.DeregisterResponse:
        await self._core.deregister(request.member_id, credential=_credential(context))
        self._uploads.forget(request.member_id)
        return apb.DeregisterResponse()
