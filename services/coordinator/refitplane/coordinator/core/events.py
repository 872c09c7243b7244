"""In-process change notifications for refit records (what WatchRefit streams)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from refitplane.coordinator.core.records import RefitRecord


class RefitEvents:
    def __init__(self) -> None:
        self._subscribers: dict[str, set[asyncio.Queue[RefitRecord]]] = {}
        self._observers: list[Callable[[RefitRecord], None]] = []

    def observe(self, observer: Callable[[RefitRecord], None]) -> None:
        """Call `observer` with every record published (of every refit)."""
        self._observers.append(observer)

    def publish(self, record: RefitRecord) -> None:
        for observer in self._observers:
            observer(record)
        for q in self._subscribers.get(record.refit_id, ()):
            # Watchers want the latest record, not every intermediate one: keep one slot.
            if q.full():
                q.get_nowait()
            q.put_nowait(record)

    @contextmanager
    def subscribe(self, refit_id: str) -> Iterator[asyncio.Queue[RefitRecord]]:
        q: asyncio.Queue[RefitRecord] = asyncio.Queue(maxsize=1)
        self._subscribers.setdefault(refit_id, set()).add(q)
        try:
            yield q
        finally:
            subs = self._subscribers.get(refit_id)
            if subs is not None:
                subs.discard(q)
                if not subs:
                    del self._subscribers[refit_id]
