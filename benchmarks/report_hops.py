#!/usr/bin/env python3
"""The control hops inside TRANSFERRING (issue 23) against a real coordinator, no data plane.

    python benchmarks/report_hops.py --refits 30                      # coordinator as a process
    python benchmarks/report_hops.py --coordinator thread --refits 30  # in this process, as
                                                                       # gpu_refit.py's world
    REFIT_REPORT_STREAM=0 python benchmarks/report_hops.py ...         # every report unary
    REFIT_LANE=0 python benchmarks/report_hops.py ...                  # gRPC streams, no lane

One process per data-plane rank (`--ranks TxRxG`: T trainer ranks, R generator replicas of G
ranks, no sidecar), each a real `AgentSession` whose simulated executor sleeps
`--executor-ms` at StartTransfer and then reports TransferDone with its hop stamps, so the
ranks' reports land together, as a refit's do. The coordinator runs as its own process
(`python -m refitplane.coordinator`, embedded store unless `--redis`), as in production, or
(`--coordinator thread`) on a thread of this process, as `refitplane.testing.refit_world`
runs it for `gpu_refit.py`: there this process's main thread watches the refit (WatchRefit,
one record decoded per change) beside the coordinator's loop, in one interpreter.
`--watch poll` reads the refit every 20 ms instead of watching.

Per refit it takes the hop timeline from the record (docs/coordinator.md, "The hop
timeline") and prints, over the steady refits (min / median / max, ms):

    start->seen      the coordinator's StartTransfer to each rank's handler
    sent->recorded   each rank's TransferDone sent to the coordinator's driver accepting it
                     (first and last report of the refit separately)
    last->end        the last report accepted to the end of TRANSFERRING
    T-executor       TRANSFERRING minus the simulated executor: what control costs

and, measured in the same run after the refits, one message's one-way time between two
processes on gRPC-Python alone (`grpc_floor.py`: client stream to aio server, as an agent's
reports go over gRPC) and on the control lane's framing and threads alone (`lane_floor.py`):
the floor of each hop above on this machine, for either path (`--no-floor` skips them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from control_overhead import RankSpec, rank_processes, serve_simulated_rank, wait_published
from control_plane import coordinator as coordinator_process
from control_plane import redis_server, rows_layout

from refitplane.client import RefitClient
from refitplane.protocol import RefitState
from refitplane.protocol.models import Refit
from refitplane.testing.hops import hop_ms, last_report_to_phase_end_ms, stamped_ranks


def agent_main(args: argparse.Namespace) -> int:
    """One rank: register, publish, answer commands; StartTransfer sleeps `executor_ms`."""
    from refitplane.agent.simulated import Behaviour

    behaviour = Behaviour(executor_s=args.executor_ms / 1e3, progress=False)
    return serve_simulated_rank(args, rows_layout(args.rank, args.world), behaviour)


def agents(
    target: str, job: str, spec: tuple[int, int, int], executor_ms: float
) -> contextlib.AbstractContextManager[None]:
    trainers, replicas, gen_tp = spec
    ranks: list[RankSpec] = [("trainer", r, trainers, "") for r in range(trainers)]
    ranks += [("generator", r, gen_tp, f"r{i}") for i in range(replicas) for r in range(gen_tp)]
    script = str(Path(__file__).resolve())
    # REFIT_REPORT_STREAM and REFIT_LANE reach the ranks: the A/B switches.
    extra = ("--executor-ms", str(executor_ms))
    keep = ("REFIT_REPORT_STREAM", "REFIT_LANE")
    return rank_processes(script, ranks, target, job, *extra, keep_env=keep)


@contextlib.contextmanager
def a_coordinator(args: argparse.Namespace) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server()) if args.redis else ""
        if args.coordinator == "thread":
            from refitplane.testing.coordinator import start_coordinator

            running = start_coordinator(
                lease_ttl_s=60.0, transfer_timeout_s=60.0, **({"redis_url": url} if url else {})
            )
            stack.callback(running.stop)
            yield running.grpc_target
        else:
            yield stack.enter_context(coordinator_process(url, lease_ttl_s=60.0))


def one_refit(client: RefitClient, job: str, i: int, watch: str) -> Refit:
    refit_id = client.trigger(job, idempotency_key=f"hops-{i}").refit_id
    if watch == "watch":
        return client.wait(refit_id, timeout_s=60)
    deadline = time.monotonic() + 60
    while True:
        refit = client.get(refit_id)
        if refit.terminal or time.monotonic() > deadline:
            return refit
        time.sleep(0.02)


def hops_of(refit: Refit, executor_ms: float) -> dict[str, float]:
    ranks = stamped_ranks(refit)
    per = [hop_ms(refit, r) for r in ranks]
    seen = [h["coordinator->start seen"] or 0.0 for h in per]
    recorded = sorted(h["sent->recorded"] or 0.0 for h in per)
    by_end = sorted(ranks, key=lambda r: r.done_recorded_ns)
    phase = sum(t.seconds for t in refit.timings if t.phase is RefitState.TRANSFERRING) * 1e3
    return {
        "start->seen (max)": max(seen),
        "sent->recorded (first)": hop_ms(refit, by_end[0])["sent->recorded"] or 0.0,
        "sent->recorded (last)": hop_ms(refit, by_end[-1])["sent->recorded"] or 0.0,
        "sent->recorded (max)": recorded[-1],
        "last->end": last_report_to_phase_end_ms(refit) or 0.0,
        "TRANSFERRING": phase,
        "T-executor": phase - executor_ms,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        p = argparse.ArgumentParser()
        p.add_argument("agent")
        for flag in ("--role", "--replica", "--coordinator", "--job"):
            p.add_argument(flag, default="")
        p.add_argument("--rank", type=int, default=0)
        p.add_argument("--world", type=int, default=1)
        p.add_argument("--executor-ms", type=float, default=20.0)
        return agent_main(p.parse_args())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1x1x1", help="TxRxG: trainers x replicas x ranks each")
    p.add_argument("--refits", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--executor-ms", type=float, default=20.0)
    p.add_argument("--coordinator", choices=("process", "thread"), default="process")
    p.add_argument("--watch", choices=("watch", "poll"), default="watch")
    p.add_argument("--redis", action="store_true", help="a redis-server store (default embedded)")
    p.add_argument(
        "--no-floor", action="store_true", help="skip gRPC's and the lane's own one-way times"
    )
    args = p.parse_args()
    spec = tuple(int(x) for x in args.ranks.split("x"))
    if len(spec) != 3:
        p.error("--ranks is TxRxG")
    job = "hops"
    stream = os.environ.get("REFIT_REPORT_STREAM", "1")
    lane = os.environ.get("REFIT_LANE", "1")
    with (
        a_coordinator(args) as target,
        RefitClient(target, timeout_s=60) as client,
        agents(target, job, spec, args.executor_ms),
    ):
        members = spec[0] + spec[1] * spec[2]
        wait_published(client, job, members, 120)
        rows: list[dict[str, Any]] = []
        for i in range(args.warmup + args.refits):
            refit = one_refit(client, job, i, args.watch)
            if refit.state is not RefitState.COMMITTED:
                raise RuntimeError(f"refit {i}: {refit.state.value} {refit.reason}")
            if i >= args.warmup:
                rows.append(hops_of(refit, args.executor_ms))
    print(
        f"report_hops: ranks {args.ranks}, coordinator {args.coordinator}, "
        f"{'redis' if args.redis else 'embedded'} store, {args.watch}, executor "
        f"{args.executor_ms:g} ms, REFIT_REPORT_STREAM={stream}, REFIT_LANE={lane}, {len(rows)} "
        "refits (ms)"
    )
    series = {key: [r[key] for r in rows] for key in rows[0]}
    if not args.no_floor:
        import grpc_floor
        import lane_floor

        series["gRPC one-way (floor)"] = grpc_floor.one_way_ms()
        series["lane one-way (floor)"] = lane_floor.one_way_ms()
    for key, values in series.items():
        print(
            f"  {key:<24} min {min(values):7.2f}  median {statistics.median(values):7.2f}  "
            f"max {max(values):7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
