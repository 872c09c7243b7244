#!/usr/bin/env python3
"""The data plane alone on a model-shaped plan, against the raw ceiling of the same links.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python benchmarks/model_refit.py --model qwen3-8b --layout tp2 --out results.json

Layouts (`--layout`, see `model_layouts.GPU_LAYOUTS`): trainer TP2 on GPUs 0-1 → generator
TP2 or two TP1 replicas on GPUs 2-3 (4 GPUs), or trainer TP1 → TP1 (2 GPUs); Qwen3 shapes,
bf16; no vLLM and no control plane: what the executor itself costs, and where. In one
world, one run:

- ceiling: nccl4py send/recv of each link's bytes in 1 GiB messages, one group per link;
- messages: the plan's own messages (the executor's schedule, straight from/to the shards),
  posted in the executor's group sizes, no checksums: NCCL's cost for those message sizes;
- executor: `Executor.run` with verification off and on, per stream count, with its host
  timeline (schedule + views resolved, everything posted, done);
- host costs: microseconds per posted op and per checksum launch.

`--profile` also writes a cProfile of one verified refit on a sender and a receiver.
`--fused-runs` has receivers hold each fused run (MoE `w13`/`w2`, q/k/v) in one allocation
as vLLM does, so run messages land in place; `--scratch-gib N` bounds the ceiling's and the
message step's scratch to N GiB reused in turn, so the Qwen3-30B-A3B shape (57 GiB of
weights per GPU) fits an H100:

    python benchmarks/model_refit.py --model qwen3-30b-a3b --layout tp1 --streams 4 --fused-runs --scratch-gib 4
`gpu_refit.py` measures the same plus vLLM and the control plane; this one isolates the
executor so a gap to the ceiling can be attributed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from refitplane.testing.model_layouts import GPU_LAYOUTS

MiB = 1 << 20


def _fused_memory(layout: Any, rank: int, device: Any) -> dict[tuple[str, Any], Any]:
    """For every box of a fused run (`runs.py`: a MoE layer's expert gate/up projections,
    its down projections, q/k/v), a view into one allocation per run, in the run's memory
    order: the receiver as vLLM holds `w13`, `w2` and `qkv_proj`."""
    import torch

    from refitplane.reshard.boxes import box_numel, box_shape
    from refitplane.reshard.runs import run_of
    from refitplane.reshard.shards import torch_dtype

    runs: dict[Any, list[tuple[Any, str, Any, Any]]] = {}
    for t in layout:
        run = run_of(t.spec.name)
        if run is not None:
            for box in t.boxes.get(rank, ()):
                runs.setdefault(run[0], []).append((run[1], t.spec.name, box, t.spec))
    views: dict[tuple[str, Any], Any] = {}
    for members in runs.values():
        members.sort(key=lambda member: member[0])
        sizes = [box_numel(box) * spec.itemsize for _, _, box, spec in members]
        memory = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        offset = 0
        for (_, name, box, spec), size in zip(members, sizes, strict=True):
            part = memory[offset : offset + size].view(torch_dtype(spec.dtype))
            views[(name, box)] = part.view(box_shape(box))
            offset += size
    return views


def _shards(layout: Any, rank: int, device: Any, fill: bool, fused: bool = False) -> Any:
    import torch

    from refitplane.reshard.boxes import box_shape
    from refitplane.reshard.shards import LocalShards, torch_dtype

    shards = LocalShards()
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    fused_views = _fused_memory(layout, rank, device) if fused else {}
    for t in layout:
        for box in t.boxes.get(rank, ()):
            local = fused_views.get((t.spec.name, box))
            if local is None:
                local = torch.empty(box_shape(box), dtype=torch_dtype(t.spec.dtype), device=device)
            if fill:
                raw = local.view(-1).view(torch.uint8)
                raw.copy_(
                    torch.randint(
                        0, 256, raw.shape, dtype=torch.uint8, device=device, generator=gen
                    )
                )
            shards.add(t.spec, box, local)
    return shards


def _timed(barrier: Any, fn: Any) -> float:
    import torch

    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    barrier.wait()
    return seconds


def _repeat(barrier: Any, fn: Any, repeats: int) -> list[float]:
    """`repeats` timed runs after an untimed one (first touch, lazy NCCL connections)."""
    return [_timed(barrier, fn) for _ in range(repeats + 1)][1:]


def _post_all(transport: Any, groups: list[tuple[int, list[Any]]]) -> float:
    """Post every (channel, ops) group in order, then wait for all; returns the host
    posting time."""
    deadline = time.monotonic() + 300
    t0 = time.perf_counter()
    handles = [transport.issue(ch, ops, deadline) for ch, ops in groups if ops]
    posted = time.perf_counter() - t0
    for h in handles:
        transport.wait(h, deadline)
    return posted


class _Scratch:
    """Memory for the timing-only steps (no checksums: what lands there is never read):
    one allocation per request, or with `cap` bytes, slices of one arena reused in turn (the
    MoE shape's plan is as large as the weights; a second copy does not fit one H100)."""

    def __init__(self, device: Any, cap: int) -> None:
        import torch

        self.device = device
        self.arena = torch.empty(cap, dtype=torch.uint8, device=device) if cap else None
        self.at = 0

    def take(self, nbytes: int) -> Any:
        import torch

        if self.arena is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes > self.arena.numel():
            raise ValueError(f"--scratch-gib is smaller than one message ({nbytes} bytes)")
        if self.at + nbytes > self.arena.numel():
            self.at = 0
        buf = self.arena[self.at : self.at + nbytes]
        self.at = (self.at + nbytes + 255) // 256 * 256
        return buf


def _message_groups(
    plan: Any, shards: Any, rank: int, cfg: Any, scratch: _Scratch
) -> list[tuple[int, list[Any]]]:
    """The executor's messages for `cfg` as P2P ops (direct views and spans, scratch for
    packed ones), on the executor's channels, cut into groups the way it cuts them (4
    buckets or 64 ops)."""
    from refitplane.reshard.message_io import resolve_message
    from refitplane.reshard.op_group import GROUP_BUCKETS, GROUP_MAX_OPS
    from refitplane.reshard.schedule import rank_schedule
    from refitplane.reshard.transport.base import P2POp

    groups: list[tuple[int, list[Any]]] = []
    open_groups: dict[int, tuple[list[Any], list[int]]] = {}
    for m in rank_schedule(plan, cfg).messages:
        io = resolve_message(m, shards, plan.specs)
        buf = io.direct if io.direct is not None else scratch.take(m.nbytes)
        ops, size = open_groups.get(m.channel, (None, [0]))
        if ops is None or size[0] >= GROUP_BUCKETS * cfg.bucket_bytes or len(ops) >= GROUP_MAX_OPS:
            ops, size = [], [0]
            open_groups[m.channel] = (ops, size)
            groups.append((m.channel, ops))
        sending = m.src == rank
        ops.append(P2POp(sending, m.dst if sending else m.src, buf))
        size[0] += m.nbytes
    return groups


def _host_costs(device: Any) -> dict[str, float]:
    """Microseconds of host time per checksum launch: one 1 MiB buffer, and 64 of them in
    one launch (as a group of messages is summed); kernel already compiled."""
    import torch

    from refitplane.reshard.checksum import accumulate_sums_many

    bufs = [torch.zeros(MiB, dtype=torch.uint8, device=device) for _ in range(64)]
    table = torch.zeros((64, 2), dtype=torch.int64, device=device)
    rows = [table[i] for i in range(64)]
    accumulate_sums_many(bufs[:1], rows[:1])
    torch.cuda.synchronize()
    out = {}
    for label, n in (("checksum_launch_us", 1), ("checksum_launch_64_us", 64)):
        t0 = time.perf_counter()
        for _ in range(200):
            accumulate_sums_many(bufs[:n], rows[:n])
        out[label] = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    return out


def _worker(
    *,
    rank: int,
    world: int,
    transport: Any,
    barrier: Any,
    model: str,
    layout: str,
    streams: list[int],
    bucket_mib: int,
    direct_mib: int,
    repeats: int,
    profile: bool,
    scratch_gib: float = 0.0,
    fused: bool = False,
) -> dict[str, Any]:
    import torch

    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.executor import Executor
    from refitplane.reshard.planner import build_plan
    from refitplane.reshard.transport.base import P2POp
    from refitplane.testing.model_layouts import model_layouts

    device = transport.device
    trainers = GPU_LAYOUTS[layout].trainer_tp
    source, target = model_layouts(model, GPU_LAYOUTS[layout])
    plan = build_plan(source, target)
    rp = plan.rank_plan(rank)
    receiver = rank >= trainers
    shards = _shards(
        target if receiver else source, rank, device, fill=not receiver, fused=fused and receiver
    )
    bucket = bucket_mib * MiB
    out: dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(device)}
    # Whole GiB: every 1 GiB ceiling message then fits the arena from any of its offsets.
    cap = int(scratch_gib) << 30 if scratch_gib else 0
    if scratch_gib and cap < 1 << 30:
        raise ValueError("--scratch-gib must be at least 1")

    # 1. ceiling: each link's bytes in 1 GiB messages.
    scratch = _Scratch(device, cap)
    ceiling_ops = []
    for link in sorted((*rp.sends, *rp.recvs), key=lambda link: (link.src, link.dst)):
        sending = link.src == rank
        peer = link.dst if sending else link.src
        for o in range(0, link.nbytes, 1 << 30):
            ceiling_ops.append(P2POp(sending, peer, scratch.take(min(1 << 30, link.nbytes - o))))
    out["ceiling_s"] = _repeat(barrier, partial(_post_all, transport, [(0, ceiling_ops)]), repeats)
    ceiling_ops.clear()
    torch.cuda.empty_cache()

    # 2. the plan's messages, executor-sized groups on its channels, no checksums.
    def config(streams: int, verify: bool = True) -> TransferConfig:
        return TransferConfig(
            bucket_bytes=bucket,
            num_channels=streams,
            max_inflight_bytes=4 * bucket,
            direct_min_bytes=direct_mib * MiB,
            verify_checksums=verify,
            timeout_s=120,
        )

    out["messages"] = []
    for s in streams:
        groups = _message_groups(rp, shards, rank, config(s), scratch)
        posted: list[float] = []

        def post_groups(groups: list[Any] = groups, posted: list[float] = posted) -> None:
            posted.append(_post_all(transport, groups))

        count = sum(len(ops) for _, ops in groups)
        out["messages"].append(
            {
                "streams": s,
                "count": count,
                "groups": len(groups),
                "seconds": _repeat(barrier, post_groups, repeats),
                "post_us_per_op": 1e6 * statistics.median(posted[1:]) / max(1, count),
            }
        )
        groups.clear()

    # 3. the executor (the scratch arena goes first: its memory is the executor's now).
    del scratch
    torch.cuda.empty_cache()
    rows = []
    for verify in (False, True):
        for s in streams:
            ex = Executor(transport, config(s, verify))
            reports: list[Any] = []

            def run(ex: Any = ex, reports: list[Any] = reports) -> None:
                reports.append(ex.run(rp, shards))

            times = [0.0, *_repeat(barrier, run, repeats)]
            rows.append(
                {
                    "verify": verify,
                    "streams": s,
                    "seconds": times[1:],
                    "prepared_s": [r.prepared_seconds for r in reports[1:]],
                    "posted_s": [r.posted_seconds for r in reports[1:]],
                    "run_s": [r.seconds for r in reports[1:]],
                    "verified": f"{reports[-1].tensors_verified}/{reports[-1].tensors_total}",
                }
            )
            if profile and verify and s == max(streams) and rank in (0, trainers):
                prof = cProfile.Profile()
                barrier_ok = _timed(barrier, partial(prof.runcall, ex.run, rp, shards))
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                out["profile"] = f"profiled run {barrier_ok:.4f} s\n" + text.getvalue()
            elif profile and verify and s == max(streams):
                _timed(barrier, partial(ex.run, rp, shards))
            ex.ring.free()
    out["executor"] = rows
    out.update(_host_costs(device))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--layout", default="tp2", choices=sorted(GPU_LAYOUTS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bucket", type=int, default=256, help="MiB")
    parser.add_argument("--direct", type=int, default=16, help="MiB (REFIT_DIRECT_MIN_BYTES)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--scratch-gib",
        type=float,
        default=0.0,
        help="bound the ceiling's and the message step's scratch to this many GiB, reused "
        "(0: a copy of the plan's bytes; the Qwen3-30B-A3B shape on an H100 needs a bound, e.g. 4)",
    )
    parser.add_argument(
        "--fused-runs",
        action="store_true",
        help="receivers hold each fused run (MoE w13/w2, qkv) in one allocation, as vLLM does",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from refitplane.testing.nccl_world import ranks_or_report, run_nccl_world

    gpus = GPU_LAYOUTS[args.layout].gpus
    results = run_nccl_world(
        _worker,
        gpus,
        channels=max(args.streams),
        model=args.model,
        layout=args.layout,
        streams=args.streams,
        bucket_mib=args.bucket,
        direct_mib=args.direct,
        repeats=args.repeats,
        profile=args.profile,
        scratch_gib=args.scratch_gib,
        fused=args.fused_runs,
    )
    ranks = ranks_or_report(results, gpus)
    if ranks is None:
        return 1

    def slowest(key: str, rows: list[dict[str, Any]] | None = None) -> float:
        src = rows if rows is not None else ranks
        return float(max(statistics.median(r[key]) for r in src))

    from refitplane.reshard.planner import build_plan
    from refitplane.testing.model_layouts import model_layouts

    source, target = model_layouts(args.model, GPU_LAYOUTS[args.layout])
    plan = build_plan(source, target)
    per_dest: dict[int, int] = {}
    for link in plan.links:
        per_dest[link.dst] = per_dest.get(link.dst, 0) + link.nbytes
    dest_bytes = max(per_dest.values())
    total = sum(link.nbytes for link in plan.links)
    ceiling = slowest("ceiling_s")

    def line(what: str, sec: float, extra: str = "") -> None:
        print(
            f"  {what:<34} {sec * 1e3:8.1f} ms {dest_bytes / sec / 1e9:7.1f} GB/s {100 * ceiling / sec:6.1f}%  {extra}"
        )

    print(
        f"{args.model} {args.layout}: {total / 2**30:.2f} GiB over {len(plan.links)} links, "
        f"{ranks[0]['messages'][0]['count']} messages on rank 0; "
        f"{ranks[0]['device']} x{gpus}"
    )
    print(f"  {'what':<34} {'time':>11} {'per dest':>12} {'% ceil':>7}")
    line("ceiling (1 GiB messages)", ceiling)
    for i, row in enumerate(ranks[0]["messages"]):
        line(
            f"plan's messages, streams={row['streams']} (raw)",
            float(max(statistics.median(r["messages"][i]["seconds"]) for r in ranks)),
            f"{row['groups']} groups, post {max(r['messages'][i]['post_us_per_op'] for r in ranks):.1f} us/op",
        )
    summary_rows = []
    for i, row in enumerate(ranks[0]["executor"]):
        per_rank = [r["executor"][i] for r in ranks]
        sec = slowest("seconds", per_rank)
        prep = slowest("prepared_s", per_rank)
        post = slowest("posted_s", per_rank)
        line(
            f"executor verify={'on' if row['verify'] else 'off'} streams={row['streams']}",
            sec,
            f"prepared {prep * 1e3:.1f} ms, posted {post * 1e3:.1f} ms, {per_rank[-1]['verified']} verified",
        )
        summary_rows.append(
            {
                **{k: row[k] for k in ("verify", "streams")},
                "seconds": sec,
                "prepared_s": prep,
                "posted_s": post,
            }
        )
    print(
        f"  checksum host time: {max(r['checksum_launch_us'] for r in ranks):.1f} us for one buffer, "
        f"{max(r['checksum_launch_64_us'] for r in ranks):.1f} us for 64 in one launch"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for r in ranks:
            if "profile" in r:
                (args.out.parent / f"profile-rank{r['rank']}.txt").write_text(r.pop("profile"))
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": str(args.out)},
                    "python": platform.python_version(),
                    "bytes": total,
                    "dest_bytes": dest_bytes,
                    "ceiling_s": ceiling,
                    "rows": summary_rows,
                    "ranks": ranks,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
