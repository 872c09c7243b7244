"""The outermost gRPC interceptor: times and counts every unary and server-streaming call by
the status it ended with (after RefitInterceptor mapped domain errors to codes)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from refitplane.coordinator.grpc.interceptor import Context, Handler
from refitplane.coordinator.observability.requests import RequestMetrics


def _code(context: Context, failed: BaseException | None) -> grpc.StatusCode:
    if isinstance(failed, asyncio.CancelledError):
        # The client went away (a watch it stopped, an agent's stream closing) or the server
        # is stopping: the call may be gone already, so nothing is read from it.
        return grpc.StatusCode.CANCELLED
    # None until the call set or aborted with a code (the stubs say StatusCode).
    code: object = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.OK if failed is None else grpc.StatusCode.UNKNOWN


class RequestObserver(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: RequestMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        metrics = self._metrics

        @contextlib.contextmanager
        def observed(context: Context, *, unary: bool) -> Iterator[None]:
            started, failed = time.perf_counter(), None
            # Read while the call is live: peer() on a call that already ended (a stream the
            # client cancelled) dereferences a freed call in cygrpc and kills the process.
            peer = context.peer() or ""
            try:
                yield
            except BaseException as exc:
                failed = exc
                raise
            finally:
                duration_s = time.perf_counter() - started
                code = _code(context, failed)
                metrics.grpc_call(method, code, duration_s, unary=unary, peer=peer)

        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary

            async def unary_behavior(request: Any, context: Context) -> Any:
                with observed(context, unary=True):
                    return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_behavior,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        if handler.unary_stream is not None:
            stream: Any = handler.unary_stream

            async def stream_behavior(request: Any, context: Context) -> AsyncIterator[Any]:
                with observed(context, unary=False):
                    async for item in stream(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(
                stream_behavior,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # client and bidirectional streams (reflection): not observed
