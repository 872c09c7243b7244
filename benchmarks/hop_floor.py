"""What `grpc_floor.py` and `lane_floor.py` share: a stamping server in a process of its own
(it records each message's arrival with `time.time_ns()`, the host's clock, which this
process shares) and the one-way times from the send and arrival stamps."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterator
from typing import Any

# serve(ports, stamps, count): put the bound port on `ports`, the (seq, arrival ns) list on
# `stamps` once message `count` arrived.
Serve = Callable[[Any, Any, int], None]


@contextlib.contextmanager
def stamping_server(
    serve: Serve, count: int, timeout_s: float
) -> Iterator[tuple[int, Callable[[], list[tuple[int, int]]]]]:
    """`serve` in a spawned process: its port, and a call that waits for its stamps."""
    ctx = mp.get_context("spawn")
    ports, stamps = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=serve, args=(ports, stamps, count), daemon=True)
    server.start()
    try:
        yield ports.get(timeout=timeout_s), lambda: stamps.get(timeout=timeout_s)
    finally:
        server.terminate()
        server.join(5)


def one_way_ms(sent: dict[int, int], arrived: list[tuple[int, int]], count: int) -> list[float]:
    """Each message's one-way time (ms), the first tenth left out (warm-up)."""
    times = [(at - sent[seq]) / 1e6 for seq, at in arrived]
    return times[count // 10 :]
