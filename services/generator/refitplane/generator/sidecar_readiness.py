"""The sidecar's readiness as vLLM last answered it, so that `/readyz` never waits for vLLM.

Whether the replica can serve depends on vLLM: its `/health`, and whether every worker still
holds the replica's version (the refitplane engines' status, one dev-mode `/collective_rpc`
that a busy or stuck vLLM is slow to answer: the sidecar allows it `max_age_s`, and an ask
that timed out is not ready). Kubernetes probes every few seconds, so
`/readyz` asks neither: `WorkerCheck` asks every `interval_s` on a thread of its own, beside
the session's lease thread, and `/readyz` reads the last answer. It is not ready while that
answer is older than `max_age_s` (vLLM too slow to answer, or the check stuck), or says a
worker holds incomplete weights (vLLM's sleep at level 2 discarded them): asking is also
what lowers the sidecar's version to the one the workers hold (`engines_hold_version`), so
a replica never reports a version it does not hold.

An in-process `LLM` (`OfflineLLMControl`) is its caller's to drive, from the caller's thread
(vLLM's engine client is not thread-safe): it is asked when `/readyz` asks, as before, and
costs no HTTP round trip.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("refitplane.sidecar")


@dataclass(frozen=True)
class WorkerAnswer:
    """What vLLM answered: `message` is empty when it can serve, else why not."""

    message: str
    at: float  # time.monotonic() of the answer

    @property
    def ok(self) -> bool:
        return not self.message


class WorkerCheck:
    """Asks `ask` (an empty string: vLLM can serve; else why not) every `interval_s` on a
    thread of its own (`poll`), or at every read (`poll=False`); `ready` reads the answer."""

    def __init__(
        self,
        ask: Callable[[], str],
        *,
        interval_s: float,
        max_age_s: float,
        poll: bool = True,
    ) -> None:
        self._ask = ask
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self.poll = poll
        self.last = WorkerAnswer("vLLM's workers were not asked yet", time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> WorkerAnswer:
        """Ask now; the answer (or why asking failed) becomes the last one."""
        try:
            message = self._ask()
        except Exception as exc:  # the check must outlive any one answer
            log.exception("asking vLLM's workers failed")
            message = f"asking vLLM's workers failed: {type(exc).__name__}: {exc}"
        self.last = WorkerAnswer(message, time.monotonic())
        return self.last

    def start(self) -> None:
        """Poll from now on (nothing to do with `poll=False`)."""
        if not self.poll or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sidecar-workers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # An answer in flight ends with its own timeout; the thread is a daemon.
            self._thread.join(timeout=1.0)
            self._thread = None

    def ready(self) -> tuple[bool, str]:
        """Whether the last answer says vLLM can serve and is at most `max_age_s` old; the
        reason when not."""
        answer = self.last if self.poll else self.refresh()
        if not answer.ok:
            return False, answer.message
        age = time.monotonic() - answer.at
        if age > self.max_age_s:
            return False, (
                f"vLLM's workers last answered {age:.1f} s ago (bound {self.max_age_s:g} s, "
                "REFIT_WORKER_CHECK_MAX_AGE_S)"
            )
        return True, ""

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()
