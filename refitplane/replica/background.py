"""`BackgroundCaller`: engine calls made on a thread of their own, in order, each answer a
Future; the replica controller pre-arms vLLM's update with it (docs/generator.md, "The
update, pre-armed")."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class BackgroundCaller:
    """One daemon thread that runs engine calls in order, each answer handed back as a
    Future: the pre-armed update. Handing a call over does not wait for the thread (as
    starting one per call would), so the caller's next step — reporting Prepared — goes
    out first and the call is made while that report's answer is awaited."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Callable[[], int], Future[int]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable[[], int]) -> Future[int]:
        answer: Future[int] = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put((call, answer))
        return answer

    def close(self) -> None:
        """The thread ends after the call it is making, if any (it is a daemon)."""
        if self._thread is not None:
            self._calls.put(None)
            self._thread = None

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, answer = item
            try:
                answer.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
                answer.set_exception(exc)
