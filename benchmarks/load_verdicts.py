"""What `gpu_refit.py` judges a refitted replica by: its kernel tensors against vLLM's own
load of the same checkpoint in the same replica (`compare_loads`, `--quant fp8`), and
against a vLLM engine started fresh from the trainers' checkpoint, tensors and greedy
tokens (`compare_with_fresh_load`, `--fresh-load`: the oracle of issue 28,
`refitplane.testing.refit_world.fresh_load`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from refitplane.testing.model_layouts import GpuLayout
from refitplane.testing.refit_world.fresh_load import (
    KV_SCALES,
    FreshSpec,
    differences,
    fresh_load_digests,
)

# The greedy continuation the fresh-load oracle compares (`--fresh-load`).
PROMPT = (1, 2, 3, 4, 5, 6, 7)
NEW_TOKENS = 8


def compare_loads(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Kernel tensors of each refitted replica's workers against vLLM's own load (the
    baseline replica of the same index), KV-cache scales aside."""
    compared, differ = 0, []
    for i, (replica, workers) in enumerate(sorted(ours.items())):
        for worker, (got, want) in enumerate(
            zip(workers, theirs.get(f"baseline-{i}", []), strict=True)
        ):
            if got.keys() != want.keys():
                differ.append(
                    f"{replica} worker {worker}: names differ ({sorted(got.keys() ^ want.keys())[:5]})"
                )
                continue
            for name in sorted(want):
                if name.endswith(KV_SCALES):
                    continue
                compared += 1
                if got[name] != want[name]:
                    differ.append(f"{replica} worker {worker}: {name}")
    return {"compared": compared, "differ": differ}


def replica_snapshot(world: Any, name: str) -> dict[str, Any]:
    """What a refitted replica's kernels read (digests per rank) and what it serves now: the
    side of the fresh-load comparison taken while the refit world runs."""
    from refitplane.testing.kernel_tensors import kernel_tensors

    return {
        "tensors": world.ask(name, ("rpc", (kernel_tensors, ["sums"])), "rpc", timeout_s=120),
        "tokens": world.ask(name, ("tokens", (PROMPT, NEW_TOKENS)), "tokens"),
    }


def judge(
    verdict: dict[str, Any], label: str, fresh: dict[str, Any], replica: dict[str, Any]
) -> None:
    """Add to `verdict` how replica `label` (`replica_snapshot`) differs from `fresh`
    (`fresh_load_digests`): kernel tensors, then the greedy tokens."""
    if "error" in fresh:
        verdict["differ"].append(f"{label}: no fresh load: {fresh['error']}")
        return
    compared, differ = differences(fresh["tensors"], replica["tensors"])
    verdict["compared"] += compared
    verdict["differ"] += [f"{label} {d}" for d in differ]
    verdict["tokens"][label] = replica["tokens"]
    if replica["tokens"] != fresh["tokens"]:
        verdict["differ"].append(
            f"{label}: tokens {replica['tokens']}, the fresh load serves {fresh['tokens']}"
        )


def show(verdict: dict[str, Any]) -> None:
    print(
        f"  vs a fresh vLLM load of the same checkpoint: {verdict['compared']} kernel tensors "
        f"compared, {len(verdict['differ'])} differ, tokens {verdict['tokens']}",
        flush=True,
    )
    for line in verdict["differ"]:
        print(f"    {line[:400]}", flush=True)


def compare_with_fresh_load(
    out: dict[str, Any], args: argparse.Namespace, layout: GpuLayout
) -> dict[str, Any]:
    """Start vLLM fresh from the trainers' checkpoint on the first replica's GPUs (one start
    per replica TP size) and compare every refitted replica with it (module docstring)."""
    replicas = out["ours"].pop("replicas")
    model_dir = out["ours"].pop("model_dir")
    verdict: dict[str, Any] = {"compared": 0, "differ": [], "tokens": {}}
    fresh_by_tp: dict[int, dict[str, Any]] = {}
    first_gpu = layout.trainer_tp
    for i, tp in enumerate(layout.replica_tps):
        replica = replicas.get(f"replica-{i}")
        if replica is None:
            continue
        if tp not in fresh_by_tp:
            spec = FreshSpec(
                model_dir,
                args.model,
                "bfloat16",
                args.quant,
                tp,
                ",".join(str(first_gpu + k) for k in range(tp)),
                args.device,
                PROMPT,
                NEW_TOKENS,
                args.gpu_memory_utilization,
            )
            started = time.monotonic()
            fresh_by_tp[tp] = fresh_load_digests(spec)
            verdict[f"fresh_tp{tp}_s"] = time.monotonic() - started
            if "error" not in fresh_by_tp[tp]:
                verdict["tokens"][f"fresh-tp{tp}"] = fresh_by_tp[tp]["tokens"]
        judge(verdict, f"replica-{i}", fresh_by_tp[tp], replica)
    show(verdict)
    return verdict
