"""The small stdlib HTTP servers beside the main process (the coordinator's probe port, the
sidecar's health and metrics port, the test harness's control port) answer the same way: a
JSON body or raw bytes with their content type and length (the head alone to a HEAD), and
request lines logged at debug level, never on stderr."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar


class JsonRequestHandler(BaseHTTPRequestHandler):
    # Subclasses name what they serve, for the debug log ("health: GET /readyz 200").
    log_name: ClassVar[str] = "http"
    log: ClassVar[logging.Logger] = logging.getLogger(__name__)

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        self._reply_bytes(code, json.dumps(body).encode(), "application/json")

    def _reply_bytes(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        self.log.debug(f"{self.log_name}: {format}", *args)
