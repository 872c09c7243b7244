"""Per-member command queues and the streams that drain them.

Commands are queued whether or not the member's stream is connected and delivered, in
order, when it (re)connects; a newer stream for the same member replaces the older one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator

from refitplane.coordinator.core.waits import wait_event
from refitplane.errors import Unavailable
from refitplane.protocol.messages import Command, CommandBody

log = logging.getLogger(__name__)

# A member that never connects cannot make the coordinator hoard commands.
MAX_QUEUED = 4096


class _Queue:
    def __init__(self) -> None:
        self.items: collections.deque[Command] = collections.deque()
        self.seq = 0
        self.wake = asyncio.Event()
        self.stream_token = 0
        self.closed = False


class Outbox:
    def __init__(self, *, heartbeat_s: float = 15.0) -> None:
        self._queues: dict[str, _Queue] = {}
        self._heartbeat_s = heartbeat_s
        self._shut = False

    def _queue(self, member_id: str) -> _Queue:
        q = self._queues.get(member_id)
        if q is None:
            q = self._queues[member_id] = _Queue()
        return q

    def send(self, member_id: str, body: CommandBody) -> None:
        q = self._queue(member_id)
        if q.closed:
            return
        q.seq += 1
        q.items.append(Command(seq=q.seq, body=body))
        if len(q.items) > MAX_QUEUED:
            dropped = q.items.popleft()
            log.warning("member %s: command queue full, dropped command %d", member_id, dropped.seq)
        q.wake.set()

    def close(self, member_id: str) -> None:
        """The member is gone: end its stream and drop what it did not receive."""
        q = self._queues.pop(member_id, None)
        if q is not None:
            q.closed = True
            q.items.clear()
            q.wake.set()

    def close_all(self) -> None:
        """Shutdown: end every stream and refuse new ones (agents reconnect to the next
        coordinator)."""
        self._shut = True
        for member_id in list(self._queues):
            self.close(member_id)

    def connected(self, member_id: str) -> bool:
        q = self._queues.get(member_id)
        return q is not None and q.stream_token > 0

    async def stream(self, member_id: str) -> AsyncIterator[Command]:
        """Yield the member's commands until it is closed or a newer stream takes over."""
        if self._shut:
            raise Unavailable("the coordinator is shutting down")
        q = self._queue(member_id)
        q.stream_token += 1
        token = q.stream_token
        q.wake.set()  # an older stream sees the new token and ends
        try:
            while not q.closed and q.stream_token == token:
                if q.items:
                    yield q.items.popleft()
                    continue
                q.wake.clear()
                await wait_event(q.wake, self._heartbeat_s)
        finally:
            if q.stream_token == token:
                q.stream_token = 0
