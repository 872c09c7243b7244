"""The verbs a replica controller drives and the helpers both controllers share: the
generator's `refit-sidecar` (vLLM's HTTP server, or an in-process `LLM`) and the trainer's
vLLM-API engine on rank 0 (vLLM's weight-sync client)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from refitplane.client.sync import RefitClient
from refitplane.errors import FailedPrecondition, Unavailable
from refitplane.protocol import Role

log = logging.getLogger("refitplane.sidecar")

# How long one ask for the workers' engine status may take by default (one dev-mode
# /collective_rpc: every worker answers between its steps, so a busy vLLM is slow to).
ENGINE_STATUS_TIMEOUT_S = 30.0


class EngineControl(Protocol):
    """The engine verbs a sidecar drives (HTTP for a server, method calls in-process)."""

    def healthy(self) -> bool: ...
    def wait_healthy(self, timeout_s: float) -> None: ...
    def init_engine(self, init_info: dict[str, Any]) -> int: ...
    def pause(self, mode: str) -> int: ...
    def resume(self) -> int: ...
    def start_update(self) -> int: ...
    def update(self, update_info: dict[str, Any]) -> int: ...
    # None closes the update without naming a version (a discarded or failed one).
    def finish(self, version: int | None) -> int: ...
    # Every worker's engine status (the refitplane engine's status channel), or None where
    # there is none; Unavailable where an engine asked over the network did not answer
    # within `timeout_s` (an in-process one answers as its workers do: nothing to cut short).
    def engine_status(
        self, timeout_s: float = ENGINE_STATUS_TIMEOUT_S
    ) -> list[dict[str, Any]] | None: ...
    # vLLM's sleep mode (an engine started with enable_sleep_mode): whether it sleeps now,
    # waking parts of it ("weights", "kv_cache") and putting it back to sleep.
    def is_sleeping(self) -> bool: ...
    def wake_up(self, tags: list[str]) -> int: ...
    def sleep(self, level: int) -> int: ...
    def close(self) -> None: ...


class CallerPausedControl:
    """The verbs of an engine whose caller pauses it and keeps it alive (an in-process `LLM`,
    vLLM's weight-sync client): nothing to wait for, pause, resume or close here. Subclasses
    add the weight-update verbs."""

    def healthy(self) -> bool:
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        return None

    def pause(self, mode: str) -> int:
        return 200

    def resume(self) -> int:
        return 200

    # Sleep, too, is the caller's (vLLM's weight-sync clients): never asleep here.
    def is_sleeping(self) -> bool:
        return False

    def wake_up(self, tags: list[str]) -> int:
        return 200

    def sleep(self, level: int) -> int:
        return 200

    def close(self) -> None:
        return None


class StatusSink(Protocol):
    """Where a controller hands every worker's engine status after a refit (metrics)."""

    def update(self, statuses: Sequence[dict[str, Any]]) -> None: ...


def touches_live_weights(receive_modes: Sequence[str]) -> bool:
    """Whether a transfer into ranks with these `receive_mode` labels may change the served
    weights before it verified: every mode but "staged" does (live bytes land as they
    arrive; layerwise buckets are applied as they complete), as does a rank without the
    label. The coordinator reads the labels the same way."""
    return not receive_modes or any(mode != "staged" for mode in receive_modes)


def succeeded(status: int) -> bool:
    """An engine verb's HTTP status (or the one `call_verb` made of an exception) says OK."""
    return 200 <= status < 300


def http_status(exc: BaseException) -> int:
    """The HTTP status of a failed verb: the response's (an HTTP client's error), else the
    one vLLM's server would answer for this exception."""
    response_status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(response_status, int):
        return response_status
    status = getattr(exc, "http_status", None)  # vLLM's GracefulHTTPError (409 here)
    if isinstance(status, int):
        return status
    if isinstance(exc, NotImplementedError):
        return 501
    if isinstance(exc, ValueError | TypeError):
        return 400
    return 500


def call_verb(verb: str, fn: Callable[[], object]) -> int:
    """Run one engine verb; its failure becomes a status (logged), as over HTTP."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported as its status, like HTTP
        status = http_status(exc)
        text = getattr(getattr(exc, "response", None), "text", "")
        log.warning("vLLM %s failed (%d): %s %s", verb, status, exc, str(text)[:300])
        return status
    return 200


def wait_replica_ranks(
    client: RefitClient,
    job: str,
    replica_id: str,
    timeout_s: float,
    *,
    failure: Callable[[float], str] | None = None,
    failure_every_s: float = 1.0,
) -> None:
    """Wait until every vLLM worker of the replica registered and published its layout.
    `failure` (asked every `failure_every_s`) says why the workers never will (an engine
    that failed to initialise): a non-empty answer ends the wait at once with it, instead
    of at the deadline. It is given the seconds left before the deadline and must answer
    within them (an empty answer where it cannot), so that the wait ends at its deadline
    whatever the engine does."""
    deadline = time.monotonic() + timeout_s
    next_failure_check = time.monotonic() + 0.5
    while True:
        ranks = [
            m
            for m in client.topology(job).members
            if m.role == Role.GENERATOR and m.replica_id == replica_id
        ]
        if ranks and all(m.layout_digest for m in ranks) and len(ranks) == ranks[0].world_size:
            return
        now = time.monotonic()
        if failure is not None and now >= next_failure_check and now < deadline:
            why = failure(deadline - now)
            if why:
                raise FailedPrecondition(why)
            next_failure_check = time.monotonic() + failure_every_s
        if time.monotonic() > deadline:
            raise Unavailable(
                f"vLLM's workers did not register with the coordinator as replica {replica_id!r} "
                f"of job {job!r} within {timeout_s:.0f} s (found {len(ranks)}); is vLLM started "
                """with --weight-transfer-config '{"backend": "refitplane"}' and refit-plane """
                "installed in its environment? See the vLLM log"
            )
        time.sleep(0.2)


def engine_init_failure(statuses: Sequence[dict[str, Any]] | None) -> str:
    """Why a replica's workers will never register, from their refitplane engines'
    statuses: the first engine that failed to initialise, naming its rank and what failed
    (empty while none did, or where the engines cannot be asked)."""
    for status in statuses or ():
        if status.get("error") and not status.get("initialized"):
            return (
                f"vLLM worker rank {status.get('rank')} could not start the refitplane "
                f"engine: {status['error']}"
            )
    return ""
