"""Command queues survive disconnects, newer streams replace older ones, watchers get the
latest record."""

from __future__ import annotations

import asyncio

import pytest

from refitplane.coordinator.core.events import RefitEvents
from refitplane.coordinator.core.outbox import Outbox
from refitplane.coordinator.core.records import RefitRecord
from refitplane.errors import Unavailable
from refitplane.protocol import RefitState
from refitplane.protocol.messages import LeaveGroupCmd, StartTransferCmd

pytestmark = [pytest.mark.unit, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _take(stream, n):
    return [await asyncio.wait_for(anext(stream), 2) for _ in range(n)]


async def test_commands_queue_until_a_stream_connects_and_keep_order():
    box = Outbox(heartbeat_s=0.05)
    box.send("m", LeaveGroupCmd(epoch=1, abort=True))
    box.send("m", StartTransferCmd(refit_id="r", version=2))
    stream = box.stream("m")
    got = await _take(stream, 2)
    assert [c.seq for c in got] == [1, 2]
    assert isinstance(got[1].body, StartTransferCmd)
    box.send("m", StartTransferCmd(refit_id="r", version=3))
    assert (await _take(stream, 1))[0].seq == 3
    await stream.aclose()


async def test_newer_stream_replaces_older_and_close_ends_it():
    box = Outbox(heartbeat_s=0.05)
    old = box.stream("m")
    old_task = asyncio.ensure_future(anext(old))
    await asyncio.sleep(0.05)
    new = box.stream("m")
    new_task = asyncio.ensure_future(anext(new))
    await asyncio.sleep(0.05)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(old_task, 2)
    box.send("m", LeaveGroupCmd(epoch=1, abort=False))
    assert (await asyncio.wait_for(new_task, 2)).seq == 1
    box.close("m")
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(new), 2)
    box.close_all()
    with pytest.raises(Unavailable):
        await anext(box.stream("x"))


async def test_watchers_get_the_latest_record():
    events = RefitEvents()
    record = RefitRecord(refit_id="r", job="j", version=1)
    with events.subscribe("r") as q:
        events.publish(record.model_copy(update={"state": RefitState.PREPARING}))
        events.publish(record.model_copy(update={"state": RefitState.TRANSFERRING}))
        events.publish(RefitRecord(refit_id="other", job="j", version=1))
        assert q.qsize() == 1
        assert (await q.get()).state is RefitState.TRANSFERRING
    events.publish(record)  # nobody listening: no error
