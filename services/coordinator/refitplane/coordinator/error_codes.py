"""Domain errors → gRPC status codes and HTTP statuses: the one table both transports use."""

from __future__ import annotations

from http import HTTPStatus

import grpc

from refitplane import errors

# Trailing metadata keys carrying the machine-readable reason and the field at fault (clients
# and agents read them back with the same names).
from refitplane.protocol.channel import FIELD_KEY, REASON_KEY

__all__ = ["FIELD_KEY", "REASON_KEY", "grpc_status", "http_status"]

# Most specific first: the first isinstance match wins.
_TABLE: tuple[tuple[type[errors.RefitError], grpc.StatusCode, HTTPStatus], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, HTTPStatus.BAD_REQUEST),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND, HTTPStatus.NOT_FOUND),
    (errors.Conflict, grpc.StatusCode.ABORTED, HTTPStatus.CONFLICT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, HTTPStatus.CONFLICT),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, HTTPStatus.UNAUTHORIZED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, HTTPStatus.FORBIDDEN),
    (errors.RateLimited, grpc.StatusCode.RESOURCE_EXHAUSTED, HTTPStatus.TOO_MANY_REQUESTS),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    (errors.TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, HTTPStatus.GATEWAY_TIMEOUT),
)


def grpc_status(exc: errors.RefitError) -> grpc.StatusCode:
    for cls, code, _ in _TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def http_status(exc: errors.RefitError) -> HTTPStatus:
    for cls, _, status in _TABLE:
        if isinstance(exc, cls):
            return status
    return HTTPStatus.INTERNAL_SERVER_ERROR
