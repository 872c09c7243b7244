"""Logging set-up of every long-running command (coordinator, sidecar): plain text or one
JSON object per line (REFIT_LOG_JSON); the coordinator's access log
(`refitplane.coordinator.access`) on or off (REFIT_ACCESS_LOG)."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, is_dataclass


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if is_dataclass(access) and not isinstance(access, type):
            fields = asdict(access)
            doc["duration_ms"] = round(1e3 * float(fields.pop("duration_s", 0.0)), 3)
            doc |= fields
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(level: str, *, json_lines: bool, access_log: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # On: it follows REFIT_LOG_LEVEL (requests at INFO, routine successes at DEBUG).
    access = logging.getLogger("refitplane.coordinator.access")
    access.setLevel(logging.NOTSET if access_log else logging.WARNING)
