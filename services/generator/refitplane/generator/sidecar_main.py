"""`refit-sidecar`'s process: flags and REFIT_* settings, the health port, signals.

Exit statuses: 0 stopped by SIGTERM / SIGINT, 1 could not start (a port in use, vLLM not
healthy in time, the coordinator unreachable), 2 bad configuration. A signal stops it within
seconds at any point, including while it waits (up to REFIT_VLLM_START_TIMEOUT_S) for vLLM
to become healthy: start-up runs in a worker thread the main thread does not wait for.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence

from pydantic import ValidationError

from refitplane import logs
from refitplane.errors import FailedPrecondition, RefitError
from refitplane.generator.sidecar import Sidecar, SidecarSettings
from refitplane.lifecycle import (
    EXIT_BAD_CONFIGURATION,
    EXIT_STOPPED,
    StartupError,
    fail_startup,
    settings_problems,
    stop_event_on_signals,
)
from refitplane.version import __version__

log = logging.getLogger("refitplane.sidecar")

# How long a stopping sidecar spends deregistering and closing before it exits anyway.
STOP_GRACE_S = 3.0


def main(argv: Sequence[str] | None = None) -> int:
    prog = "refit-sidecar"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The generator sidecar: one per vLLM replica, next to the vLLM server.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for flag in ("coordinator", "job", "replica-id", "vllm-url", "pause-mode", "sidecar-port"):
        parser.add_argument(f"--{flag}", help=f"overrides REFIT_{flag.upper().replace('-', '_')}")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        settings = SidecarSettings(**overrides)
        logs.configure(settings.log_level.upper(), json_lines=settings.log_json)
    except ValidationError as exc:
        print(f"{prog}: invalid configuration: {settings_problems(exc)}", file=sys.stderr)
        return EXIT_BAD_CONFIGURATION
    except ValueError as exc:  # logging refuses the level
        print(f"{prog}: invalid configuration: REFIT_LOG_LEVEL: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIGURATION
    stop = stop_event_on_signals(log)
    try:
        sidecar = Sidecar(settings)
        sidecar.listen()
    except (StartupError, OSError) as exc:  # the port
        return fail_startup(prog, str(exc))
    except FailedPrecondition as exc:  # an unreadable REFIT_AUTH_TOKEN_FILE
        return fail_startup(prog, exc.message)
    try:
        return _run_until_stopped(prog, sidecar, stop)
    finally:
        _close_within(sidecar, STOP_GRACE_S)


def _run_until_stopped(prog: str, sidecar: Sidecar, stop: threading.Event) -> int:
    """Start in a worker thread (waiting for vLLM, registering), so that a signal stops the
    process at any point; then serve until a signal."""
    failure: list[str] = []

    def start() -> None:
        try:
            sidecar.start()
        except RefitError as exc:
            failure.append(exc.message)
        except Exception as exc:  # reported as the start-up failure, not a thread traceback
            log.debug("start-up failed", exc_info=True)
            failure.append(f"{type(exc).__name__}: {exc}")
        finally:
            if not sidecar.alive:
                stop.set()

    threading.Thread(target=start, name="sidecar-start", daemon=True).start()
    stop.wait()
    if failure and not sidecar.alive:
        return fail_startup(prog, failure[0])
    return EXIT_STOPPED


def _close_within(sidecar: Sidecar, timeout_s: float) -> None:
    """Deregister and close, but never hold the process past `timeout_s` (a start-up still
    in flight may keep the connections busy; its thread dies with the process)."""
    closer = threading.Thread(target=sidecar.close, name="sidecar-close", daemon=True)
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        log.warning("did not close within %.0f s: exiting anyway", timeout_s)
    else:
        log.info("stopped")


if __name__ == "__main__":
    sys.exit(main())
