"""Bounded waits that stay cancellable.

Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives as the awaited
event fires (fixed in 3.12), which would let a stopping task run on forever; these helpers
use `asyncio.timeout` instead.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` passes; True if it was set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def get_within(queue: asyncio.Queue[T], timeout_s: float) -> T | None:
    """The next item, or None after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    except TimeoutError:
        return None
