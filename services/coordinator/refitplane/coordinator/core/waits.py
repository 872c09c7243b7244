"""Bounded waits that stay cancellable.

Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives as the awaited
event fires (fixed in 3.12), which would let a stopping task run on forever; these helpers
use `asyncio.timeout` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait until it has ended (None: nothing to do), so a
    stopping owner never leaves it running; the CancelledError it ends with stops here."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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
