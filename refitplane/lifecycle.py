"""What every long-running refitplane command shares with Kubernetes' expectations: SIGTERM
and SIGINT stop it within seconds whatever it is doing (and it says so), and a start-up
failure is one line naming what failed and where, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from pydantic import ValidationError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupError(Exception):
    """The process cannot start; the message is the one line an operator reads."""


def stop_event_on_signals(log: logging.Logger) -> threading.Event:
    """An event set by SIGTERM or SIGINT (main thread only). A second signal while the
    process is already stopping exits at once: an operator pressing ^C twice means it."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            log.warning("%s again: exiting now", signal.Signals(signum).name)
            raise SystemExit(128 + signum)
        log.info("%s received: stopping", signal.Signals(signum).name)
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    return stop


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt (its args name the signal), so a
    command's `finally` blocks stop what it started, as on ^C. Main thread only (elsewhere a
    no-op: Python delivers signals to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def announce_signal(log: logging.Logger, signum: int, then: Callable[[], None]) -> None:
    """The asyncio form: log which signal arrived, then run `then` (sets the stop event)."""
    log.info("%s received: stopping", signal.Signals(signum).name)
    then()


def check_port_free(what: str, host: str, port: int, setting: str) -> None:
    """Refuse a TCP port another process listens on, before a server that would share it
    (gRPC sets SO_REUSEPORT by default, so a second server would silently listen too).
    Port 0 (any free port) always passes."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: only a listening socket blocks the probe, not connections in TIME_WAIT.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise StartupError(bind_failure(what, host, port, setting, exc)) from None


def bind_failure(what: str, host: str, port: int, setting: str, exc: OSError) -> str:
    """`cannot listen for HTTP on 0.0.0.0:8080: address already in use (set --http-port …)`."""
    if exc.errno == errno.EADDRINUSE:
        cause = "address already in use (is another instance running?)"
    elif exc.errno == errno.EACCES:
        cause = "permission denied (ports below 1024 need privileges)"
    else:
        cause = exc.strerror or str(exc)
    return f"cannot listen for {what} on {host}:{port}: {cause}; choose another with {setting}"


def settings_problems(exc: ValidationError, *, prefix: str = "REFIT_") -> str:
    """A settings object's validation errors as one line, each naming its variable:
    `REFIT_GRPC_PORT: must be <= 65535 (got '99999'); REFIT_JOB: required`."""
    parts = []
    for error in exc.errors(include_url=False):
        names = [str(p) for p in error.get("loc", ()) if isinstance(p, str)]
        variable = prefix + "_".join(names).upper() if names else ""
        message = str(error.get("msg", "invalid"))
        message = message.removeprefix("Value error, ").removeprefix("Input should be ")
        if error.get("type") == "missing":
            message = "required (set it or pass its flag)"
        elif "input" in error and error.get("type") != "value_error":
            message = f"should be {message} (got {error['input']!r})"
        parts.append(f"{variable}: {message}" if variable else message)
    return "; ".join(parts)


def fail_startup(prog: str, message: str) -> int:
    """Print the one-line start-up failure and return the exit status for it."""
    print(f"{prog}: cannot start: {message}", file=sys.stderr)
    return EXIT_CANNOT_START


# Exit statuses of the long-running commands (docs/operations.md).
EXIT_STOPPED = 0  # stopped by SIGTERM / SIGINT, cleanly
EXIT_CANNOT_START = 1  # a port in use, an unreachable store or vLLM, ...
EXIT_BAD_CONFIGURATION = 2  # invalid flags or REFIT_* settings
