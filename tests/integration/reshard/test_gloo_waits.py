"""GlooWaits over a real two-process Gloo group: a Gloo receive counts as completed only
after someone waited on it, so the CUDA IPC transport's polling relies on these threads.
The receiver's operations complete as the sender's messages arrive, in any order, one
waiting on a message the sender sends last does not hold up the others, and one whose
message never comes ends at its deadline with an error."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from refitplane.reshard.transport.gloo import GlooTransport
from refitplane.reshard.transport.gloo_waits import GlooWaits
from tests.integration.reshard.gloo_world import run_world

pytestmark = pytest.mark.integration


def _worker(*, rank: int, world: int, port: int) -> dict[str, Any]:
    transport = GlooTransport(rank, world, f"127.0.0.1:{port}".encode(), timeout_s=30)
    pg = transport._groups[0]
    if rank == 0:
        pg.send([torch.full((4,), 9, dtype=torch.uint8)], 1, 9).wait()
        for tag in (1, 2, 3):  # tag 4 is never sent
            time.sleep(0.3)
            pg.send([torch.full((4,), tag, dtype=torch.uint8)], 1, tag).wait()
        time.sleep(3.0)  # stay until the receiver's deadline passed
        transport.close()
        return {}
    waits = GlooWaits()
    bufs = {tag: torch.zeros(4, dtype=torch.uint8) for tag in (4, 3, 2, 1)}
    # Handed over last-sent first: the wait on tag 4 (never sent) is first in line.
    started = time.monotonic()
    pending = {tag: waits.submit(pg.recv([b], 0, tag), started + 2.0) for tag, b in bufs.items()}
    # Gloo alone: not completed without a wait, even once its bytes are there.
    alone_buf = torch.zeros(4, dtype=torch.uint8)
    alone = pg.recv([alone_buf], 0, 9)
    done_order: list[int] = []
    while len(done_order) < 4 and time.monotonic() - started < 10:
        for tag, p in pending.items():
            if p.done.is_set() and tag not in done_order:
                done_order.append(tag)
        time.sleep(0.01)
    waits.close()
    transport.abort()
    return {
        "order": done_order,
        "data": {tag: b.tolist() for tag, b in bufs.items()},
        "errors": {tag: p.error for tag, p in pending.items()},
        "seconds_to_fail": round(time.monotonic() - started, 1),
        "gloo_alone_completed": alone.is_completed(),
        "gloo_alone_bytes": alone_buf.tolist(),
    }


def test_receives_complete_as_they_arrive_and_a_missing_one_at_its_deadline() -> None:
    results = run_world(_worker, 2, timeout_s=60)
    status, got = results[1]
    assert status == "ok", got
    assert got["order"][:3] == [1, 2, 3]  # as the sender sent them, not as handed over
    assert got["order"][3] == 4
    assert got["data"] == {4: [0, 0, 0, 0], 3: [3] * 4, 2: [2] * 4, 1: [1] * 4}
    assert got["errors"][1] is None
    assert got["errors"][4] is not None  # never sent: ended at its 2 s deadline
    assert got["gloo_alone_bytes"] == [9] * 4
    assert got["gloo_alone_completed"] is False
