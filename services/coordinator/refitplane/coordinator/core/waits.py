"""Bounded waits that stay cancellable.

Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives as the awaited
event fires (fixed in 3.12), which would let a stopping task run on forever; these helpers
use `asyncio.timeout` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("refitplane.coordinator")


async def cancel_and_wait(
    task: asyncio.Task[None] | None, *, again_after_s: float = 0.5, give_up_after_s: float = 30.0
) -> bool:
    """Cancel a background task and wait until it has ended (None: nothing to do), so a
    stopping owner never leaves it running; the CancelledError it ends with stops here.
    True when it ended (or there was none).

    A task still running `again_after_s` after a cancellation is cancelled again, and so on:
    the cancellation may have been lost rather than slow to take effect. Code we do not own
    still uses Python 3.11's `asyncio.wait_for` (redis-py writes every command through it),
    which returns its operation's result when the cancellation lands in the loop iteration
    that operation completes in (CPython gh-86296): the task then runs on as if never
    cancelled, and the next Redis read turns the leftover cancellation into a timeout that
    redis-py retries, ~5 s each (a coordinator in start-up ignored SIGTERM for 20 s that
    way). `again_after_s` is also how long a task's own clean-up after a cancellation may
    take before it is cancelled too. A task that outlasts `give_up_after_s` of repeated
    cancellations (one that catches every CancelledError) is left running, logged by name,
    and False returned: the owner's stop must not wait forever on it."""
    if task is None:
        return True
    deadline = time.monotonic() + give_up_after_s
    while not task.done():
        if time.monotonic() >= deadline:
            log.error(
                "task %s ignored every cancellation for %.0f s: left running",
                task.get_name(),
                give_up_after_s,
            )
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=again_after_s)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return True


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
