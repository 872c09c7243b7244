"""The floor of one control hop: a message's one-way time on gRPC-Python alone, for
`report_hops.py` to print beside the coordinator's hops in the same run.

A process serves `AgentService.StreamReports` on grpc.aio with a servicer that only stamps
each request's arrival (`time.time_ns()`, the host's clock, shared with this process) and
answers it; this process sends on one stream the way an agent does (the sync stub, a
request queue that gRPC's own thread drains), one message every `gap_s`, each after the
last one's answer. No coordinator, auth, conversion or store: what a hop cannot go below
with this stack on this machine.
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
    import grpc

    from refitplane._generated.refit.v1 import agent_pb2 as apb
    from refitplane._generated.refit.v1 import agent_pb2_grpc

    arrived: list[tuple[int, int]] = []

    class Stamping(agent_pb2_grpc.AgentServiceServicer):
        async def StreamReports(self, requests: Any, context: Any) -> Any:
            async for request in requests:
                arrived.append((request.seq, time.time_ns()))
                yield apb.StreamReportsResponse(seq=request.seq, accepted=True)
                if request.seq == count:
                    stamps.put(arrived)

    async def main() -> None:
        server = grpc.aio.server()
        # Only StreamReports is served: the other methods answer UNIMPLEMENTED.
        agent_pb2_grpc.add_AgentServiceServicer_to_server(Stamping(), server)  # type: ignore[abstract]
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def one_way_ms(count: int = 300, gap_s: float = 0.005, timeout_s: float = 60.0) -> list[float]:
    """One-way times (ms) of `count` messages, the first tenth left out (warm-up)."""
    import grpc

    from refitplane._generated.refit.v1 import agent_pb2 as apb
    from refitplane._generated.refit.v1 import agent_pb2_grpc

    with (
        stamping_server(_serve, count, timeout_s) as (port, stamps),
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        requests: queue.Queue[Any] = queue.Queue()
        answers: queue.Queue[Any] = queue.Queue()
        call = stub.StreamReports(iter(requests.get, None))

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                for answer in call:
                    answers.put(answer)

        threading.Thread(target=read, daemon=True).start()
        sent: dict[int, int] = {}
        for seq in range(1, count + 1):
            sent[seq] = time.time_ns()
            requests.put(apb.StreamReportsRequest(seq=seq))
            answers.get(timeout=timeout_s)
            time.sleep(gap_s)
        arrived = stamps()
        requests.put(None)
        call.cancel()
    return hop_floor.one_way_ms(sent, arrived, count)
