"""`refit-coordinator`: start the coordinator (gRPC + REST in one process).

Configuration comes from REFIT_* environment variables (and `.env`); the flags below
override them. Without a Redis URL the embedded in-process store is used.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from refitplane.errors import RefitError
from refitplane.lifecycle import (
    EXIT_BAD_CONFIGURATION,
    EXIT_STOPPED,
    STOP_SIGNALS,
    StartupError,
    announce_signal,
    fail_startup,
    settings_problems,
)
from refitplane.version import __version__

log = logging.getLogger("refitplane.coordinator")

# A start-up cut short by a signal closes what it opened within this.
STOP_WHILE_STARTING_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="refit-coordinator",
        description="Weight-refit coordinator: gRPC (agents, orchestrators) and REST in one "
        "process. Every flag can also be set as a REFIT_* environment variable.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--grpc-host", help="REFIT_GRPC_HOST (default 0.0.0.0)")
    p.add_argument("--grpc-port", type=int, help="REFIT_GRPC_PORT (default 50051; 0: any free)")
    p.add_argument("--http-host", help="REFIT_HTTP_HOST (default 0.0.0.0)")
    p.add_argument("--http-port", type=int, help="REFIT_HTTP_PORT (default 8080; 0: any free)")
    p.add_argument(
        "--lane-port",
        help="REFIT_LANE_PORT: the agents' control lane (default 50052; 0: any free; off: none)",
    )
    p.add_argument(
        "--probe-port",
        type=int,
        help="REFIT_PROBE_PORT: /healthz and /readyz on their own thread (0: any free)",
    )
    p.add_argument("--redis-url", help="REFIT_REDIS_URL (empty: embedded in-process store)")
    p.add_argument("--log-level", help="REFIT_LOG_LEVEL (default INFO)")
    p.add_argument("--env-file", type=Path, help="read settings from this file instead of .env")
    p.add_argument(
        "--port-file",
        type=Path,
        help="once serving, write {'grpc_port': ..., 'http_port': ..., 'lane_port': ..., "
        "'probe_port': ...} "
        "here (for port 0)",
    )
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "grpc_host",
        "grpc_port",
        "http_host",
        "http_port",
        "lane_port",
        "probe_port",
        "redis_url",
        "log_level",
    )
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


async def _serve(settings: Any, port_file: Path | None) -> None:
    from refitplane.coordinator.core.waits import cancel_and_wait
    from refitplane.coordinator.server import CoordinatorServer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, announce_signal, log, sig, stop.set)
    server = CoordinatorServer(settings)
    # A signal during start-up (say, while the store is slow to answer) stops it too.
    starting = asyncio.create_task(server.start(), name="start")
    stopping = asyncio.create_task(stop.wait(), name="stop")
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        try:
            async with asyncio.timeout(STOP_WHILE_STARTING_S):
                # Cancelled again every 0.1 s until it ends: inside redis-py a cancellation
                # can be lost (cancel_and_wait says how), and start-up would then wait out
                # the store's timeouts and retries (~20 s) before it saw the signal.
                await cancel_and_wait(starting, again_after_s=0.1)
                await server.stop(graceful=False)
        except TimeoutError:
            raise StartupError(
                f"stopping on a signal: start-up did not end within {STOP_WHILE_STARTING_S:g} s"
            ) from None
        return
    stopping.cancel()
    try:
        starting.result()
    except BaseException:
        async with asyncio.timeout(STOP_WHILE_STARTING_S):
            await server.stop(graceful=False)
        raise
    # Everything allocated so far lives as long as the process: keep it out of the
    # collector's full passes, which would otherwise add milliseconds to refit latency.
    gc.freeze()
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        ports = {
            "grpc_port": server.grpc_port,
            "http_port": server.http_port,
            "lane_port": server.lane_port,
            "probe_port": server.probe_port,
        }
        tmp.write_text(json.dumps(ports))
        tmp.replace(port_file)
    await stop.wait()
    log.info("stopping gracefully")
    await server.stop(graceful=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "refit-coordinator"
    # Heavy imports after argument parsing keep --help fast.
    from refitplane import logs
    from refitplane.coordinator.settings import Settings

    try:
        settings = Settings(_env_file=args.env_file or ".env", **_overrides(args))  # type: ignore[call-arg]
    except ValidationError as exc:
        print(f"{prog}: invalid configuration: {settings_problems(exc)}", file=sys.stderr)
        return EXIT_BAD_CONFIGURATION
    logs.configure(settings.log_level, json_lines=settings.log_json, access_log=settings.access_log)
    try:
        asyncio.run(_serve(settings, args.port_file))
    except StartupError as exc:
        return fail_startup(prog, str(exc))
    except RefitError as exc:  # e.g. the state store is unreachable
        return fail_startup(prog, exc.message)
    except (OSError, ValueError) as exc:  # an unreadable TLS or token file, ...
        return fail_startup(prog, f"{type(exc).__name__}: {exc}")
    log.info("stopped")
    return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
