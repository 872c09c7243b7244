"""The one place where gRPC meets domain errors.

For every refit.v1 method the interceptor (1) checks the bearer token on mutating calls (a
stream's at its open), (2) decodes the request itself (every message of a client stream), so
undecodable bytes become INVALID_ARGUMENT naming the request rather than an opaque INTERNAL,
and (3) maps `RefitError`s to status codes with the
reason and the bad field in trailing metadata (`refit-reason`, `refit-field`). Anything
else is logged and answered INTERNAL without details.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.error_codes import FIELD_KEY, REASON_KEY, grpc_status
from refitplane.errors import InvalidArgument, RefitError

log = logging.getLogger(__name__)

_PACKAGE = "/refit.v1."
# Reads anyone may make; every other refit.v1 method needs the token.
OPEN_METHODS = frozenset(
    {
        "/refit.v1.RefitService/GetRefit",
        "/refit.v1.RefitService/ListRefits",
        "/refit.v1.RefitService/WatchRefit",
        "/refit.v1.RefitService/GetTopology",
    }
)

Context = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


async def abort_with(context: Context, exc: RefitError) -> NoReturn:
    metadata = [(REASON_KEY, exc.reason)]
    if exc.field:
        metadata.append((FIELD_KEY, exc.field))
    message = (
        f"{exc.field}: {exc.message}" if exc.field and exc.field not in exc.message else exc.message
    )
    await context.abort(grpc_status(exc), message, trailing_metadata=tuple(metadata))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


async def abort_internal(context: Context) -> NoReturn:
    await context.abort(
        grpc.StatusCode.INTERNAL,
        "internal error (details in the coordinator log)",
        trailing_metadata=((REASON_KEY, "INTERNAL"),),
    )
    raise AssertionError("context.abort returned")  # pragma: no cover


@contextlib.asynccontextmanager
async def _status_from_errors(context: Context, method: str) -> AsyncIterator[None]:
    """Both call shapes end the same way: a RefitError becomes its status code and reason,
    an abort already made passes through, anything else is logged and becomes INTERNAL."""
    try:
        yield
    except RefitError as exc:
        await abort_with(context, exc)
    except grpc.aio.AbortError:
        raise
    except Exception:
        log.exception("%s: unexpected error", method)
        await abort_internal(context)


class RefitInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenCheck) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(_PACKAGE):
            return handler
        needs_token = self._tokens.enabled and method not in OPEN_METHODS
        decode: Callable[[bytes], Any] = handler.request_deserializer or (lambda raw: raw)
        tokens = self._tokens

        def check_token(context: Context) -> None:
            if needs_token:
                auth = dict(context.invocation_metadata() or ()).get("authorization")
                tokens.check(auth if isinstance(auth, str) else None)

        def decoded(raw: bytes) -> Any:
            try:
                return decode(raw)
            except (DecodeError, ValueError, TypeError) as exc:
                raise InvalidArgument(
                    f"the {method.rsplit('/', 1)[-1]} request is not a valid protobuf "
                    f"message ({type(exc).__name__})",
                    field="request",
                ) from None

        async def prologue(raw: bytes, context: Context) -> Any:
            check_token(context)
            return decoded(raw)

        if handler.unary_unary is not None:
            # The aio server calls these behaviours with an aio context and awaits them.
            unary: Any = handler.unary_unary

            async def unary_behavior(raw: bytes, context: Context) -> Any:
                async with _status_from_errors(context, method):
                    request = await prologue(raw, context)
                    return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_behavior, response_serializer=handler.response_serializer
            )

        if handler.unary_stream is not None:
            stream: Any = handler.unary_stream

            async def stream_behavior(raw: bytes, context: Context) -> AsyncIterator[Any]:
                async with _status_from_errors(context, method):
                    request = await prologue(raw, context)
                    async for item in stream(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(
                stream_behavior, response_serializer=handler.response_serializer
            )

        if handler.stream_stream is not None:
            # StreamReports: the token at the stream's open, every message decoded here.
            bidi: Any = handler.stream_stream

            async def bidi_behavior(
                raw_requests: AsyncIterator[bytes], context: Context
            ) -> AsyncIterator[Any]:
                async def requests() -> AsyncIterator[Any]:
                    async for raw in raw_requests:
                        yield decoded(raw)

                async with _status_from_errors(context, method):
                    check_token(context)
                    async for item in bidi(requests(), context):
                        yield item

            return grpc.stream_stream_rpc_method_handler(
                bidi_behavior, response_serializer=handler.response_serializer
            )
        return handler
