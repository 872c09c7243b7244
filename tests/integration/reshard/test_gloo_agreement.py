"""A group-wide agreement over a real two-process Gloo group (`GlooTransport.all_agree`):
how a CUDA IPC group decides, once, whether its refits run as link copies — every rank
must be able to (a staged receiver cannot), else all run messages, so that no two ends of
a link ever take different paths."""

from __future__ import annotations

import time
from typing import Any

import pytest

from refitplane.reshard.transport.gloo import GlooTransport
from tests.integration.reshard.gloo_world import run_world

pytestmark = pytest.mark.integration


def _worker(*, rank: int, world: int, port: int) -> dict[str, Any]:
    transport = GlooTransport(rank, world, f"127.0.0.1:{port}".encode(), timeout_s=30)
    try:
        deadline = time.monotonic() + 20
        every = transport.all_agree(True, deadline)
        one_refuses = transport.all_agree(rank != 1, deadline)
        return {"every": every, "one_refuses": one_refuses}
    finally:
        transport.close()


def test_every_rank_gets_the_same_answer() -> None:
    results = run_world(_worker, 2, timeout_s=60)
    expected = ("ok", {"every": True, "one_refuses": False})
    assert {r: results[r] for r in range(2)} == dict.fromkeys(range(2), expected)
