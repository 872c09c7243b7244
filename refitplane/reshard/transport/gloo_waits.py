"""Completion of Gloo point-to-point operations that a caller can poll.

A Gloo send or receive counts as completed only once someone called `wait()` on it (its
bytes may have arrived long before: `is_completed()` stays False until then), and a wait
that times out closes the connection to the peer (see gloo.py). A transport that must poll
(CUDA IPC, whose control messages go over Gloo) hands each operation to `GlooWaits`: a few
daemon threads wait on them, one full wait each, up to the operation's deadline, in the
order they were handed over, and mark them done. A wait never queues behind another:
when every thread is busy (waiting on operations that depend on the peer's progress) a new
one starts, so no operation waits on one the peer cannot complete before it.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any


class Pending:
    """One operation being waited for: `done` once its wait returned; `error` if it failed
    or timed out."""

    __slots__ = ("done", "error", "work")

    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: str | None = None


class GlooWaits:
    def __init__(self, name: str = "gloo-waits") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Pending, float] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, work: Any, deadline: float) -> Pending:
        pending = Pending(work)
        with self._lock:
            if self._idle == 0:
                self._threads += 1
                self._idle += 1
                name = f"{self._name}-{self._threads}"
                threading.Thread(target=self._run, name=name, daemon=True).start()
            self._idle -= 1  # this item takes an idle thread
        self._queue.put((pending, deadline))
        return pending

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, deadline = item
            try:
                remaining = max(0.001, deadline - time.monotonic())
                if not pending.work.wait(timedelta(seconds=remaining)):
                    pending.error = "timed out"
            except RuntimeError as exc:  # Gloo reports a closed peer or a timeout this way
                pending.error = str(exc) or type(exc).__name__
            finally:
                pending.done.set()
                with self._lock:
                    self._idle += 1

    def close(self) -> None:
        """Let the threads go once the waits already handed over ended (daemon threads: a
        wait stuck on a dead peer ends at its deadline, or with the process)."""
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)
