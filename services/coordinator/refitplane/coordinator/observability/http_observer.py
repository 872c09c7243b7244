"""ASGI middleware around the REST app: times and counts every request by its route
template (read after routing, so `/v1/jobs/{job}/refits`, never the job name)."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from refitplane.coordinator.observability.requests import RequestMetrics


class HttpObserver:
    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app fails before it answers

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route: Any = scope.get("route")
            client = scope.get("client")
            self.metrics.http_request(
                scope["method"],
                getattr(route, "path", None) or "unmatched",
                scope["path"],
                status,
                time.perf_counter() - started,
                peer=f"{client[0]}:{client[1]}" if client else "",
            )
