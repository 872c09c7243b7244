"""The REST front door, a plain ASGI layer outside FastAPI, so it acts before a byte of the
body is read or parsed:

1. Probes (`/healthz`, `/readyz`, `/metrics`) go straight through: no token, no admission
   queue (a liveness probe must answer while the coordinator is at its busiest).
2. Mutating requests must carry the bearer token: 401 from the headers alone (FastAPI would
   read and parse the whole body before its dependencies run).
3. The body is capped (`REFIT_HTTP_MAX_BODY_BYTES`): 413 from `Content-Length`, or as soon
   as a chunked body passes the cap; nothing beyond the cap is ever buffered.
4. Admission (`core.admission`): reads and writes queue in separate lanes; beyond the
   queue, 429 with `Retry-After`.

Errors have the API's usual shape, `{"error": {"reason", "message", "field"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.core.admission import Admission, Lane, Overloaded
from refitplane.errors import RefitError, Unauthenticated

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
_READS = frozenset({"GET", "HEAD", "OPTIONS"})
BODY_TOO_LARGE = "PAYLOAD_TOO_LARGE"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _respond(
    send: Send,
    status: int,
    reason: str,
    message: str,
    field: str | None,
    headers: dict[str, str] | None = None,
) -> None:
    body = json.dumps({"error": {"reason": reason, "message": message, "field": field}}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        # The rest of an unread body is not worth reading: the client starts a new one.
        (b"connection", b"close"),
    ]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    def __init__(
        self, app: ASGIApp, *, tokens: TokenCheck, max_body_bytes: int, admission: Admission
    ) -> None:
        self._app = app
        self._tokens = tokens
        self._max_body = max_body_bytes
        self._admission = admission

    def _too_large(self) -> str:
        return f"the request body exceeds REFIT_HTTP_MAX_BODY_BYTES ({self._max_body} bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if scope["path"] in PROBES:
            await self._app(scope, receive, send)
            return
        reading = scope["method"] in _READS
        try:
            if not reading and self._tokens.enabled:
                self._tokens.check(_header(scope, b"authorization"))
        except Unauthenticated as exc:
            await _respond(
                send, 401, exc.reason, exc.message, exc.field, {"WWW-Authenticate": "Bearer"}
            )
            return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self._max_body:
            await _respond(send, 413, BODY_TOO_LARGE, self._too_large(), "body")
            return
        try:
            async with self._admission.slot(Lane.READ if reading else Lane.WRITE):
                await self._capped(scope, receive, send)
        except Overloaded as exc:
            await _respond(
                send,
                429,
                exc.reason,
                exc.message,
                None,
                {"Retry-After": str(exc.retry_after_s)},
            )

    async def _capped(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a receive that stops at the cap: past it the client gets 413,
        the app sees a disconnect, and whatever it answers then is dropped."""
        seen = 0
        answered = False

        async def capped_receive() -> Message:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max_body:
                    answered = True
                    await _respond(send, 413, BODY_TOO_LARGE, self._too_large(), "body")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        await self._app(scope, capped_receive, guarded_send)


def retry_after(exc: RefitError) -> dict[str, str] | None:
    """`Retry-After` for a refusal the caller may simply repeat later."""
    seconds = getattr(exc, "retry_after_s", None)
    if seconds is None and exc.reason == "RATE_LIMITED":
        seconds = 1
    return None if seconds is None else {"Retry-After": str(seconds)}
