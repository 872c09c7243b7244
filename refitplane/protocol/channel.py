"""How a call reaches the coordinator over gRPC and how its failure comes back, for the
orchestrator client and the agent session: channels (TLS, message size limit, keepalive,
reconnect), the bearer token as call metadata, and status codes plus the trailers the
coordinator sets (`REASON_KEY`, `FIELD_KEY`) back into `refitplane.errors`."""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio

from refitplane import errors

# Trailing metadata keys carrying the machine-readable reason and the field at fault (the
# coordinator sets them, clients and agents read them back).
REASON_KEY = "refit-reason"
FIELD_KEY = "refit-field"
# The largest message either end sends or accepts (a large model's plan, coordinator to
# agent). The coordinator accepts far less (REFIT_GRPC_MAX_RECEIVE_BYTES, 4 MiB by default).
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# Agents publish a layout larger than this in chunks of at most this size (well below the
# smallest receive limit a coordinator may be given, 2 MiB).
LAYOUT_CHUNK_BYTES = 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Long-lived command streams: notice a dead coordinator within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect within ~2 s once a restarted coordinator is back (gRPC's default backs off
    # to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
Metadata = tuple[tuple[str, str], ...]

_BY_REASON: dict[str, type[errors.RefitError]] = {
    cls.reason: cls
    for cls in (
        errors.InvalidArgument,
        errors.LayoutError,
        errors.CoverageError,
        errors.NotFound,
        errors.Conflict,
        errors.FailedPrecondition,
        errors.Unauthenticated,
        errors.PermissionDenied,
        errors.RateLimited,
        errors.Unavailable,
    )
}
_BY_CODE: dict[grpc.StatusCode, type[errors.RefitError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.Conflict,
    grpc.StatusCode.ABORTED: errors.Conflict,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.RateLimited,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
}


# The metadata key a member presents its own credential under (RegisterResponse).
MEMBER_CREDENTIAL_KEY = "x-refit-member-credential"
# A report on a StreamReports stream (a Failure's message, a rendezvous) stays below this;
# a larger one goes by the unary Report, under the server's whole-message limit.
MAX_STREAM_REPORT_BYTES = 64 * 1024


def auth_metadata(token: str | None) -> Metadata:
    return (("authorization", f"Bearer {token}"),) if token else ()


def member_metadata(token: str | None, credential: str) -> Metadata:
    """What a member sends on every call after Register: the shared token (when the
    coordinator has one) and its own credential."""
    return (*auth_metadata(token), (MEMBER_CREDENTIAL_KEY, credential))


def _credentials(tls_ca: str | Path | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())


def sync_channel(target: str, *, tls_ca: str | Path | None = None) -> grpc.Channel:
    creds = _credentials(tls_ca)
    if creds is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)


def aio_channel(target: str, *, tls_ca: str | Path | None = None) -> grpc.aio.Channel:
    creds = _credentials(tls_ca)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, creds, options=CHANNEL_OPTIONS)


def _trailer(exc: grpc.RpcError, key: str) -> str | None:
    trailing = getattr(exc, "trailing_metadata", None)
    items = trailing() if callable(trailing) else None
    for k, v in items or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def from_rpc_error(exc: grpc.RpcError) -> errors.RefitError:
    """The domain error a failed call stands for (reason and field from the trailers)."""
    code_fn = getattr(exc, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(exc, "details", None)
    details = (details_fn() if callable(details_fn) else None) or str(code)
    reason = _trailer(exc, REASON_KEY)
    field = _trailer(exc, FIELD_KEY)
    if code == grpc.StatusCode.UNAVAILABLE and reason is None:
        details = f"coordinator unreachable: {details}"
    return error_for(reason or "", details, field, default=_BY_CODE.get(code, errors.RefitError))


def error_for(
    reason: str,
    message: str,
    field: str | None,
    *,
    default: type[errors.RefitError] = errors.RefitError,
) -> errors.RefitError:
    """The domain error for a reason the coordinator sent (`default`'s class for one this
    side does not know, keeping the reason)."""
    cls = _BY_REASON.get(reason) or default
    err = cls(message, field=field)
    if reason and reason != cls.reason:
        err.reason = reason
    return err


def status_code(exc: grpc.RpcError) -> grpc.StatusCode:
    code_fn = getattr(exc, "code", None)
    return code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
