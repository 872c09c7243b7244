#!/usr/bin/env python3
"""Executor vs raw nccl4py P2P between two GPUs, same bytes, same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python benchmarks/p2p_refit.py --gib 4 --out results.json

For each case ("whole": parameter-to-parameter; "tp2": column halves → row halves, so the
receiver stages and unpacks) it measures the raw ceiling (nccl4py send/recv of the same
byte volume in 1 GiB messages, one group) and the executor for each stream count and
bucket size, with checksum verification on, and once with it off. Prints a table; the
receiver checks every byte after the last run of each case.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from typing import Any

from refitplane.testing.nccl_world import ranks_or_report, run_nccl_world

MiB = 1 << 20


def _worker(
    *,
    rank: int,
    world: int,
    transport: Any,
    barrier: Any,
    gib: float,
    streams: list[int],
    buckets: list[int],
    repeats: int,
) -> dict[str, Any]:
    import torch

    from refitplane.reshard.config import TransferConfig
    from refitplane.testing import p2p_cases as pc

    device = transport.device
    out: dict[str, Any] = {"cases": {}}
    for name in ("whole", "tp2"):
        case = pc.make_case(name, gib)
        layout = case.source if rank == 0 else case.target
        shards = pc.make_shards(layout, rank, device, fill=rank == 0)
        plan = pc.rank_plan(case, rank)
        raw = [
            pc.raw_p2p(transport, barrier, rank, case.total_bytes, 1 << 30)
            for _ in range(repeats + 1)
        ][1:]
        rows = []
        for verify in (True, False):
            for s in streams:
                for b in buckets:
                    cfg = TransferConfig(
                        bucket_bytes=b * MiB,
                        num_channels=s,
                        max_inflight_bytes=max(4 * b, 256) * MiB,
                        verify_checksums=verify,
                        timeout_s=120,
                    )
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                    times = []
                    ex = None
                    for _ in range(repeats + 1):
                        sec, ex = pc.timed_refit(transport, barrier, plan, shards, cfg, ex)
                        times.append(sec)
                    peak_extra = torch.cuda.max_memory_allocated(device) - base
                    rows.append(
                        {
                            "verify": verify,
                            "streams": s,
                            "bucket_mib": b,
                            "seconds": times[1:],
                            "peak_extra_mib": peak_extra / MiB,
                        }
                    )
                    ex.ring.free()
                    del ex
        bad = pc.mismatches(layout, rank, shards) if rank == 1 else []
        out["cases"][name] = {
            "bytes": case.total_bytes,
            "raw_seconds": raw,
            "runs": rows,
            "mismatches": bad,
        }
        del shards
        torch.cuda.empty_cache()
    out["device"] = torch.cuda.get_device_name(device)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--buckets", type=int, nargs="+", default=[16, 64, 256, 1024], help="MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write raw results (JSON) here")
    args = parser.parse_args()
    results = run_nccl_world(
        _worker,
        2,
        channels=max(args.streams),
        gib=args.gib,
        streams=args.streams,
        buckets=args.buckets,
        repeats=args.repeats,
    )
    ranks = ranks_or_report(results, 2)
    if ranks is None:
        return 1
    send, recv = ranks
    summary: dict[str, Any] = {
        "device": recv["device"],
        "python": platform.python_version(),
        "cases": {},
    }
    ok = True
    print(f"device: {recv['device']} x2   volume: {args.gib} GiB per case (GB = 1e9 bytes)")
    for name, case in recv["cases"].items():
        nbytes = case["bytes"]
        raw_s = max(
            statistics.median(case["raw_seconds"]),
            statistics.median(send["cases"][name]["raw_seconds"]),
        )
        raw_gbs = nbytes / raw_s / 1e9
        print(
            f"\ncase {name}: raw nccl4py P2P {raw_gbs:6.1f} GB/s  ({nbytes / 2**30:.2f} GiB in {raw_s * 1e3:.1f} ms)"
        )
        print(
            f"  {'verify':>6} {'streams':>7} {'bucket':>8} {'ms':>8} {'GB/s':>7} {'% raw':>6} {'recv +MiB':>9} {'send +MiB':>9}"
        )
        rows = []
        for r_recv, r_send in zip(case["runs"], send["cases"][name]["runs"], strict=True):
            sec = max(statistics.median(r_recv["seconds"]), statistics.median(r_send["seconds"]))
            gbs = nbytes / sec / 1e9
            row = {
                **{k: r_recv[k] for k in ("verify", "streams", "bucket_mib")},
                "seconds": sec,
                "gb_s": gbs,
                "pct_raw": 100 * gbs / raw_gbs,
                "recv_peak_extra_mib": r_recv["peak_extra_mib"],
                "send_peak_extra_mib": r_send["peak_extra_mib"],
            }
            rows.append(row)
            print(
                f"  {'on' if row['verify'] else 'off':>6} {row['streams']:>7} {row['bucket_mib']:>6}Mi {sec * 1e3:8.1f} {gbs:7.1f} {row['pct_raw']:5.1f}% {row['recv_peak_extra_mib']:9.0f} {row['send_peak_extra_mib']:9.0f}"
            )
        best = max(rows, key=lambda r: r["gb_s"] if r["verify"] else 0)
        print(
            f"  best (verified): {best['gb_s']:.1f} GB/s = {best['pct_raw']:.1f}% of raw  [streams {best['streams']}, bucket {best['bucket_mib']} MiB]"
        )
        print(
            f"  bytes exact: {'yes' if not case['mismatches'] else 'NO: ' + ', '.join(case['mismatches'][:5])}"
        )
        ok = ok and not case["mismatches"]
        summary["cases"][name] = {
            "bytes": nbytes,
            "raw_gb_s": raw_gbs,
            "rows": rows,
            "best": best,
            "bytes_exact": not case["mismatches"],
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
