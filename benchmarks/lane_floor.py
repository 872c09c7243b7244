"""The floor of one control hop on the control lane, beside `grpc_floor.py`'s: a report's
one-way time through the lane's own framing and threads, for `report_hops.py` to print in
the same run.

A process serves the framing on an asyncio server, as the coordinator's `LaneServer` does,
stamping each report frame's arrival (`time.time_ns()`, the host's clock) and answering it;
this process sends the way an agent's `ControlLane` does: its loop on a thread of its own,
each frame handed to it with `call_soon_threadsafe`, the answer back through a queue, one
report every `gap_s` after the last one's answer. No coordinator, hello, auth or conversion.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any

import hop_floor
from hop_floor import stamping_server


def _serve(ports: Any, stamps: Any, count: int) -> None:
    from refitplane._generated.refit.v1 import agent_pb2 as apb
    from refitplane.protocol import lane as wire

    arrived: list[tuple[int, int]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header = await reader.readexactly(wire.HEADER.size)
                length = wire.frame_length(header, wire.MAX_AGENT_FRAME_BYTES, "agent")
                frame = wire.decode(await reader.readexactly(length), "agent")
                seq = frame.report.seq
                arrived.append((seq, time.time_ns()))
                answer = apb.StreamReportsResponse(seq=seq, accepted=True)
                writer.write(wire.encode(apb.LaneFrame(answer=answer)))
                if seq == count:
                    stamps.put(arrived)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def one_way_ms(count: int = 300, gap_s: float = 0.005, timeout_s: float = 60.0) -> list[float]:
    """One-way times (ms) of `count` reports, the first tenth left out (warm-up)."""
    from refitplane._generated.refit.v1 import agent_pb2 as apb
    from refitplane.protocol import lane as wire

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    answers: queue.Queue[int] = queue.Queue()
    readers: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    async def connect(port: int) -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def read() -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    header = await reader.readexactly(wire.HEADER.size)
                    body = await reader.readexactly(wire.HEADER.unpack(header)[0])
                    answers.put(wire.decode(body, "coordinator").answer.seq)

        readers.add(loop.create_task(read()))
        return writer

    try:
        with stamping_server(_serve, count, timeout_s) as (port, stamps):
            writer = asyncio.run_coroutine_threadsafe(connect(port), loop).result(timeout_s)
            sent: dict[int, int] = {}
            report = apb.ReportRequest(member_id="floor", refit_id="floor", prepared=apb.Prepared())
            for seq in range(1, count + 1):
                data = wire.encode(
                    apb.LaneFrame(report=apb.StreamReportsRequest(report=report, seq=seq))
                )
                sent[seq] = time.time_ns()
                loop.call_soon_threadsafe(writer.write, data)
                answers.get(timeout=timeout_s)
                time.sleep(gap_s)
            arrived = stamps()
            loop.call_soon_threadsafe(writer.close)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    return hop_floor.one_way_ms(sent, arrived, count)
