"""Bounded admission: at most `limit` requests of a lane run at once, at most `queued` wait
behind them (first come, first served) for up to `wait_s`; anyone beyond is refused at once
with `Overloaded` (429 + Retry-After), never left to pile up on the store.

Reads and writes are separate lanes, so a flood of reads can fill only the read lane: a
trigger or a cancel always finds its own slots.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from refitplane.errors import RateLimited


class Lane(enum.StrEnum):
    READ = "read"
    WRITE = "write"


class Overloaded(RateLimited):
    """Refused by admission: the caller should retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Gate:
    def __init__(self, lane: Lane, limit: int, queued: int, wait_s: float) -> None:
        self.lane = lane
        self.limit = limit
        self.max_queued = queued
        self.wait_s = wait_s
        self._slots = asyncio.Semaphore(limit)
        self.running = 0
        self.queued = 0

    def _refuse(self, why: str) -> Overloaded:
        return Overloaded(
            f"the coordinator is busy ({self.lane.value} requests: {why}); retry later",
            retry_after_s=max(1, math.ceil(self.wait_s / 4)),
        )

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots.locked():
            if self.queued >= self.max_queued:
                raise self._refuse(f"{self.limit} running, {self.queued} queued")
            self.queued += 1
            try:
                async with asyncio.timeout(self.wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise self._refuse(f"none finished within {self.wait_s:g} s") from None
            finally:
                self.queued -= 1
        else:
            await self._slots.acquire()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()


class Admission:
    """One gate per lane; `slot(lane)` holds a place for the duration of a request."""

    def __init__(self, *, limit: int, queued: int, wait_s: float) -> None:
        self._gates = {lane: _Gate(lane, limit, queued, wait_s) for lane in Lane}

    def slot(self, lane: Lane) -> AbstractAsyncContextManager[None]:
        return self._gates[lane].slot()

    def load(self) -> dict[Lane, tuple[int, int]]:
        """(running, queued) per lane, for metrics and tests."""
        return {lane: (g.running, g.queued) for lane, g in self._gates.items()}
