"""What a replica controller's command stream tells it at once, for the StartTransfer that
waits on the session's worker thread: the coordinator's RanksVerified (every rank of the
replica verified) and AbortRefit (the refit failed). Both arrive on the stream thread, never
queued behind the StartTransfer (docs/generator.md, "Waiting for the ranks")."""

from __future__ import annotations

import threading

from refitplane.protocol.messages import AbortRefitCmd, RanksVerifiedCmd


class StreamNews:
    """The latest RanksVerified and AbortRefit, and an event that wakes a waiter on either."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verified: RanksVerifiedCmd | None = None
        self._abort: AbortRefitCmd | None = None
        self._arrived = threading.Event()

    def ranks_verified(self, cmd: RanksVerifiedCmd) -> None:
        with self._lock:
            self._verified = cmd
        self._arrived.set()

    def aborted(self, cmd: AbortRefitCmd) -> None:
        with self._lock:
            self._abort = cmd
        self._arrived.set()

    def new_refit(self, refit_id: str) -> None:
        """A refit begins: an AbortRefit of another one (or one without an id, which aborts
        whatever runs) no longer applies."""
        with self._lock:
            if self._abort is not None and self._abort.refit_id != refit_id:
                self._abort = None

    def of(self, refit_id: str) -> tuple[RanksVerifiedCmd | None, AbortRefitCmd | None]:
        """What arrived for `refit_id`: its RanksVerified, an AbortRefit that ends it."""
        with self._lock:
            verified, abort = self._verified, self._abort
        if verified is not None and verified.refit_id != refit_id:
            verified = None
        if abort is not None and abort.refit_id not in ("", refit_id):
            abort = None
        return verified, abort

    def clear(self) -> None:
        """Before looking (`of`): news landing in between still wakes the next `wait`."""
        self._arrived.clear()

    def wait(self, timeout_s: float) -> None:
        self._arrived.wait(timeout_s)
