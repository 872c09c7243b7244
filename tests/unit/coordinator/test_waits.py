"""cancel_and_wait ends a task whose cancellation was lost (as Python 3.11's asyncio.wait_for
loses one inside redis-py), leaves a short clean-up after a cancellation alone, and gives up
(logged, False) on a task that ignores every cancellation, so no stop waits forever."""

from __future__ import annotations

import asyncio

import pytest

from refitplane.coordinator.core.waits import cancel_and_wait

pytestmark = [pytest.mark.unit, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_task_that_loses_its_first_cancellation_still_ends():
    waiting = asyncio.Event()
    lost = asyncio.Event()

    async def loses_one_cancellation() -> None:
        try:
            waiting.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost.set()  # what 3.11's wait_for does when its operation completes meanwhile
        await asyncio.sleep(3600)  # then it runs on, as a start-up waiting on its store did

    task = asyncio.create_task(loses_one_cancellation())
    await waiting.wait()
    stopping = asyncio.create_task(cancel_and_wait(task, again_after_s=0.05))
    ended, _ = await asyncio.wait({stopping}, timeout=10)
    task.cancel()  # cleanup if it did not end
    assert stopping in ended, "the task ran on after its first cancellation was lost"
    assert lost.is_set()
    assert task.cancelled()


async def test_a_short_clean_up_after_the_cancellation_is_not_cut_short():
    waiting = asyncio.Event()
    cleaned = asyncio.Event()

    async def cleans_up() -> None:
        try:
            waiting.set()
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)
            cleaned.set()

    task = asyncio.create_task(cleans_up())
    await waiting.wait()
    await cancel_and_wait(task, again_after_s=5.0)
    assert cleaned.is_set()
    assert task.cancelled()


async def test_a_task_that_ignores_every_cancellation_is_given_up_on():
    waiting = asyncio.Event()
    release = asyncio.Event()
    cancellations = 0

    async def ignores_cancellations() -> None:
        nonlocal cancellations
        waiting.set()
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancellations += 1

    task = asyncio.create_task(ignores_cancellations(), name="stubborn")
    await waiting.wait()
    ended = await cancel_and_wait(task, again_after_s=0.02, give_up_after_s=0.2)
    assert ended is False
    assert not task.done()
    assert cancellations >= 2  # it was cancelled again and again before the owner gave up
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done()
