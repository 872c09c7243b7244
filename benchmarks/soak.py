#!/usr/bin/env python3
"""Soak benchmark: continuous refits between real processes, resources sampled as it runs.

    python benchmarks/soak.py                                # 200 refits, then to 10 minutes
    python benchmarks/soak.py --refits 200 --minutes 0       # just the 200 back to back
    python benchmarks/soak.py --minutes 10 --crowd 1000 --sample-s 30 --json out.json

Starts redis-server, the coordinator process, 2 trainer ranks and 2 generator replicas
(TP2 + TP1; `refitplane.testing.cluster.agent_procs`, Gloo on CPU) and 1,000 more registered agents
(grpc.aio, renewing their leases), then refits back to back: a training step on both
trainers (new bytes), a trigger, a wait for COMMITTED; every 10th refit the generators'
bytes are compared with the trainers'. Every --sample-s seconds it prints each process's
resident memory, threads, open file descriptors and (agents) communicator sets open. Exits
1 if a refit did not commit or anything grew between the first and the last sample
(`refitplane.testing.cluster.soak` says what "stable" means).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from refitplane.testing.cluster.soak import run_soak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--refits", type=int, default=200, help="at least this many refits")
    p.add_argument("--minutes", type=float, default=10.0, help="and at least this long")
    p.add_argument("--crowd", type=int, default=1000, help="extra registered agents")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--rss-budget-mib", type=int, default=32, help="allowed RSS growth")
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args()
    print(
        f"soak: >= {args.refits} refits and >= {args.minutes:g} min, crowd {args.crowd}; "
        f"{platform.node()} {platform.machine()} Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="refit-soak-") as tmp:
        report = run_soak(
            Path(tmp),
            refits=args.refits,
            duration_s=args.minutes * 60,
            crowd=args.crowd,
            sample_every_s=args.sample_s,
            rss_budget_kib=args.rss_budget_mib * 1024,
            log=lambda line: print(line, flush=True),
        )
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
