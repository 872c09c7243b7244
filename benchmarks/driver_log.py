"""The in-process coordinator's line per committed refit (`RefitRun.critical_path`: which
member each phase waited for last, and how far into the phase) for benchmarks that run the
coordinator in their own process, shown when REFIT_LOG_LEVEL is set."""

from __future__ import annotations

import logging
import os


def show_critical_path() -> None:
    level = os.environ.get("REFIT_LOG_LEVEL")
    if level:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("refitplane.coordinator.core.driver").setLevel(level)
