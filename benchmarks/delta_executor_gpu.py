#!/usr/bin/env python3
"""Delta refits through the executor alone (no vLLM, no control plane): where a delta
refit's time goes on each end, against the full refit of the same plan.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python benchmarks/delta_executor_gpu.py --model qwen3-8b --transports nvlink net --out r.json

Trainer TP1 on GPU 0 → generator TP1 on GPU 1 (`model_layouts`), synthetic bf16 weights.
Per transport ("nvlink": NCCL's defaults; "net": NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, the
socket path cross-node traffic takes), one world: full refits (no delta links), then the
sender keeps its base (`DeltaSnapshot` on the device) and, per changed fraction, flips the
lowest bit of that fraction of every tensor's elements and refits with delta links, as the
agents do under REFIT_DELTA=auto. Each refit is timed between barriers with both devices
synchronized, and both ends' `TransferReport`s are kept (delta exchange, posting, waiting,
verifying; every message checksummed: `tensors_verified`). `--profile` adds one profiled 1 %
delta refit per end: the top CUDA kernels and host ops (torch.profiler) and the top Python
functions (cProfile), written next to `--out`.

The link decision (`delta_cost.never_pays`): where the sender's rate (REFIT_DELTA_LINK_GBPS,
else measured by the full refits) says no delta can win, the full refits' checksum exchange
tells the receiver, and the delta rows run the full path ("full-path link(s)" 1, "header
table(s)" 0) with the sender's base released, as the agent does. REFIT_DELTA_LINK_GBPS=off:
no rate, main's fraction rule (the baseline).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

from model_refit import _shards, _timed

from refitplane.testing.model_layouts import GPU_LAYOUTS

MiB = 1 << 20
TRANSPORTS = {
    "nvlink": {},
    "net": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
_REPORT_KEYS = (
    "seconds",
    "delta_seconds",
    "wire_seconds",
    "prepared_seconds",
    "posted_seconds",
    "host_add_seconds",
    "host_post_seconds",
    "host_after_seconds",
    "host_wait_seconds",
    "verify_seconds",
    "groups",
    "messages",
    "delta_messages",
    "bytes_sent",
    "bytes_received",
    "bytes_full",
    "tensors_verified",
    "tensors_total",
    "delta_base_advanced",
    "delta_base_needed",
    "delta_full_links",
    "delta_tables",
)


def _flip(shards: Any, fraction: float, seed: int) -> None:
    """Flip the lowest bit of `fraction` of every shard's elements (seeded)."""
    import torch

    for i, sv in enumerate(shards):
        words = sv.tensor.view(-1).view(torch.int16)
        gen = torch.Generator(device=words.device).manual_seed(seed * 100003 + i)
        words[torch.rand(words.numel(), device=words.device, generator=gen) < fraction] ^= 1


def _profiled(run: Any, label: str) -> str:
    """One run under torch.profiler and one under cProfile: their top entries as text (both
    ends run this, so their runs pair up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages()
    text = [f"== {label}: torch.profiler, by device time"]
    text.append(table.table(sort_by="self_cuda_time_total", row_limit=25))
    text.append(f"== {label}: torch.profiler, by host time")
    text.append(table.table(sort_by="self_cpu_time_total", row_limit=25))
    stats = cProfile.Profile()
    stats.runcall(run)
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(stats, stream=buf).sort_stats("tottime").print_stats(30)
    text.append(f"== {label}: cProfile, by own time")
    text.append(buf.getvalue())
    return "\n".join(text)


def _worker(
    *,
    rank: int,
    world: int,
    transport: Any,
    barrier: Any,
    model: str,
    bucket_mib: int,
    direct_mib: int,
    streams: int,
    fractions: list[float],
    repeats: int,
    profile: bool,
) -> dict[str, Any]:
    import torch

    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.delta_base import DeltaSnapshot
    from refitplane.reshard.delta_exchange import DeltaLinks
    from refitplane.reshard.executor import Executor
    from refitplane.reshard.planner import build_plan
    from refitplane.testing.model_layouts import model_layouts

    device = transport.device
    source, target = model_layouts(model, GPU_LAYOUTS["tp1"])
    plan = build_plan(source, target).rank_plan(rank)
    sender = rank == 0
    shards = _shards(source if sender else target, rank, device, fill=sender)
    config = TransferConfig(
        bucket_bytes=bucket_mib * MiB,
        num_channels=streams,
        max_inflight_bytes=4 * bucket_mib * MiB,
        direct_min_bytes=direct_mib * MiB,
        timeout_s=120,
    )
    executor = Executor(transport, config)
    reports: list[Any] = []

    def refit(links: DeltaLinks | None) -> None:
        reports.append(executor.run(plan, shards, delta=links))

    out: dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(device)}
    refit(None)  # first touch; the receiver now holds the sender's bytes
    full = [_timed(barrier, lambda: refit(None)) for _ in range(repeats)]
    out["full"] = {"seconds": full, "reports": [_report(r) for r in reports[-repeats:]]}
    snapshot = DeltaSnapshot("device")
    version = 1
    if sender:
        snapshot.capture(shards, version)

    def delta_refit() -> None:
        nonlocal version
        links = DeltaLinks(
            peers=frozenset({1 - rank}),
            base=snapshot.base_for(shards) if sender else None,
            current=shards if sender else None,
        )
        refit(links)
        version += 1
        if sender:
            snapshot.after_send(shards, version, reports[-1])  # as the agent does

    seed = 0
    rows = []
    for fraction in [0.01, *fractions]:  # the first 1 %: untimed (kernels compile)
        times = []
        for _ in range(repeats):
            seed += 1
            if sender:
                _flip(shards, fraction, seed)
            times.append(_timed(barrier, delta_refit))
        rows.append(
            {
                "fraction": fraction,
                "seconds": times,
                "reports": [_report(r) for r in reports[-repeats:]],
            }
        )
    out["delta"] = rows[1:]
    if profile:

        def flipped() -> None:
            nonlocal seed
            seed += 1
            if sender:
                _flip(shards, 0.01, seed)
            delta_refit()

        barrier.wait()
        out["profile"] = _profiled(flipped, f"rank {rank}, 1 % delta refit (sender: flips first)")
        barrier.wait()
    return out


def _report(report: Any) -> dict[str, Any]:
    return {k: getattr(report, k) for k in _REPORT_KEYS}


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}"


def _print(name: str, ranks: list[dict[str, Any]]) -> None:
    send, recv = ranks
    full = statistics.median(
        max(a, b) for a, b in zip(send["full"]["seconds"], recv["full"]["seconds"], strict=True)
    )
    last = send["full"]["reports"][-1]
    rate = last["bytes_sent"] / max(1e-9, last["wire_seconds"])
    # The rate "auto" decides against (`delta_cost`), unless REFIT_DELTA_LINK_GBPS is set.
    print(
        f"[{name}] full refit {full * 1e3:.1f} ms ({send['device']}); sender's link rate "
        f"{rate / 1e9:.1f} GB/s, REFIT_DELTA_LINK_GBPS={os.environ.get('REFIT_DELTA_LINK_GBPS')}"
    )
    print(
        f"  {'changed':>8} {'ms':>8} {'x full':>7} {'wire/full':>9} | sender: delta_s posted_s "
        "wait_s verify_s | receiver: delta_s posted_s wait_s after_s verify_s | verified"
    )
    for s_row, r_row in zip(send["delta"], recv["delta"], strict=True):
        sec = statistics.median(
            max(a, b) for a, b in zip(s_row["seconds"], r_row["seconds"], strict=True)
        )
        s, r = s_row["reports"][-1], r_row["reports"][-1]
        wire = s["bytes_sent"] / max(1, s["bytes_full"])
        print(
            f"  {s_row['fraction'] * 100:>7.2f}% {sec * 1e3:8.1f} {full / sec:6.2f}x {wire:9.4f} | "
            f"{s['delta_seconds'] * 1e3:.1f} {s['posted_seconds'] * 1e3:.1f} "
            f"{s['host_wait_seconds'] * 1e3:.1f} {s['verify_seconds'] * 1e3:.1f} | "
            f"{r['delta_seconds'] * 1e3:.1f} {r['posted_seconds'] * 1e3:.1f} "
            f"{r['host_wait_seconds'] * 1e3:.1f} {r['host_after_seconds'] * 1e3:.1f} "
            f"{r['verify_seconds'] * 1e3:.1f} | {r['tensors_verified']}/{r['tensors_total']}, "
            f"{r['delta_messages']}/{r['messages']} delta, {r['groups']} groups, "
            f"{r['delta_full_links']} full-path link(s), {r['delta_tables']} header table(s)"
        )
        _print_repeats(s_row, r_row)
    print("  full refits:")
    _print_repeats(send["full"], recv["full"])


def _print_repeats(s_row: dict[str, Any], r_row: dict[str, Any]) -> None:
    """Every repeat, not only the median and the last report: a one-off stall of one end
    (the receiver's 81 ms after_s in one 20 % row, 2026-11-26) shows as one slow repeat."""
    each = [max(a, b) for a, b in zip(s_row["seconds"], r_row["seconds"], strict=True)]
    after = [rep["host_after_seconds"] for rep in r_row["reports"]]
    print(
        f"  {'':>8} each repeat ms: {' '.join(f'{t * 1e3:.1f}' for t in each)}; "
        f"receiver after_s ms: {' '.join(f'{t * 1e3:.1f}' for t in after)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--transports", nargs="+", default=["nvlink"], choices=TRANSPORTS)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=256, help="MiB")
    parser.add_argument("--direct", type=int, default=16, help="MiB (REFIT_DIRECT_MIN_BYTES)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.001, 0.01, 0.2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from refitplane.testing.nccl_world import ranks_or_report, run_nccl_world

    out: dict[str, Any] = {
        "args": vars(args) | {"out": str(args.out)},
        "python": platform.python_version(),
    }
    failed = False
    for name in args.transports:
        saved = dict(os.environ)
        os.environ.update(TRANSPORTS[name])  # inherited by the spawned ranks
        try:
            results = run_nccl_world(
                _worker,
                2,
                channels=args.streams,
                timeout_s=300,
                model=args.model,
                bucket_mib=args.bucket,
                direct_mib=args.direct,
                streams=args.streams,
                fractions=args.fractions,
                repeats=args.repeats,
                profile=args.profile,
            )
        finally:
            os.environ.clear()
            os.environ.update(saved)
        ranks = ranks_or_report(results, 2)
        if ranks is None:
            failed = True
            continue
        for r in ranks:
            text = r.pop("profile", None)
            if text and args.out:
                (args.out.parent / f"profile-{name}-rank{r['rank']}.txt").write_text(text)
        _print(name, ranks)
        out[name] = ranks
        failed |= any(
            rep["tensors_verified"] != rep["tensors_total"]
            for row in ranks[1]["delta"]
            for rep in row["reports"]
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
