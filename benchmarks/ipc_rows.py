"""One row of `ipc_refit.py`: refits of ours on a refit world's colocated or cross-GPU
replica, each after a synthetic optimizer step, with the receiver's own parts of it and
every live vLLM box compared byte for byte with the trainer's tensors afterwards; the row's
medians and its printed form."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from refitplane.testing.refit_world.world import RefitResult, World


def check_boxes(world: World, steps: list[Any]) -> dict[str, Any]:
    """Every live box of the replica against the synthetic weights after `steps`, byte for
    byte, in its worker (`worker_probes.check_replayed_weights`)."""
    from refitplane.testing.refit_world.worker_probes import check_replayed_weights

    reports = world.ask(
        "replica-0", ("rpc", (check_replayed_weights, [list(steps)])), "rpc", timeout_s=120
    )
    failures = [f for r in reports for f in r["failures"]]
    checked = sum(r["checked"] for r in reports)
    return {"checked": checked, "failures": failures[:5], "exact": checked > 0 and not failures}


def receiver_parts(world: World) -> dict[str, float]:
    """The vLLM worker's own transfer of the last refit, in parts: "executor" (its wall time:
    the data plane without the coordinator's command and report round trips), "prepare"
    (up to its first manifest asked), "wait" (for its senders' manifests), "wire" (from the
    first manifest asked to the copies' end), "verify" (the sums compared, answers sent)."""
    from refitplane.testing.refit_world.worker_probes import report_seconds, transfer_report

    reports = world.ask("replica-0", ("rpc", (transfer_report, [])), "rpc", timeout_s=60)
    last = max(reports, key=lambda r: float(r.get("seconds", 0.0)))
    parts = report_seconds(last)
    return {
        "executor": parts["executor"],
        "prepare": parts["prepare"],
        "wait": float(last.get("host_wait_seconds", 0.0)),
        "wire": parts["wire"],
        "verify": parts["verify"],
    }


def make_row(
    label: str,
    results: list[RefitResult],
    checks: list[dict[str, Any]],
    receiver: list[dict[str, float]] | None = None,
) -> dict[str, Any]:
    bad = [f"{r.state} {r.reason}" for r in results if r.state != "COMMITTED"]
    receiver = receiver or []
    receiver_s = [parts["executor"] for parts in receiver]
    return {
        "label": label,
        "receiver_s": [round(s, 5) for s in receiver_s],
        "receiver_parts_ms": [{k: round(v * 1e3, 2) for k, v in p.items()} for p in receiver],
        "hops": [r.hops for r in results],
        "receiver_median_s": statistics.median(receiver_s) if receiver_s else 0.0,
        "total_s": [round(r.seconds, 4) for r in results],
        "transfer_s": [round(r.transfer_s, 4) for r in results],
        "total_median_s": statistics.median(r.seconds for r in results),
        "transfer_median_s": statistics.median(r.transfer_s for r in results),
        "bytes": results[0].bytes_total,
        "verified": all(r.tensors_verified == r.tensors_total > 0 for r in results),
        "exact": all(c["exact"] for c in checks),
        "checked_boxes": checks[-1]["checked"] if checks else 0,
        # Median seconds per coordinator phase (where trigger -> COMMITTED goes).
        "phases_median_s": {
            phase: statistics.median(r.phases.get(phase, 0.0) for r in results)
            for phase in results[0].phases
        },
        "failed": bad + [f for c in checks for f in c["failures"]][:5],
    }


def print_row(case: str, row: dict[str, Any], limit_s: float) -> None:
    gbs = row["bytes"] / row["transfer_median_s"] / 1e9 if row["transfer_median_s"] else 0.0
    print(
        f"[{case}] {row['label']}: trigger->COMMITTED {row['total_median_s']:.3f} s, data plane "
        f"{row['transfer_median_s']:.3f} s ({gbs:.1f} GB/s, {row['transfer_median_s'] / limit_s:.2f}x "
        f"the copy limit {limit_s * 1e3:.1f} ms), receiver executor "
        f"{row['receiver_median_s'] * 1e3:.2f} ms ({row['receiver_median_s'] / limit_s:.2f}x), "
        f"verified={row['verified']} exact={row['exact']} "
        f"({row['checked_boxes']} boxes) {row['failed'] or ''}",
        flush=True,
    )
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["phases_median_s"].items())
    print(f"[{case}] {row['label']} phases (ms): {phases}", flush=True)
    for parts, hops in zip(row.get("receiver_parts_ms", []), row.get("hops", []), strict=False):
        print(
            f"[{case}] {row['label']} receiver (ms): "
            + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
            + (f"; {hops}" if hops else ""),
            flush=True,
        )


def free_gib() -> float:
    """Free memory on GPU 0 as the driver sees it (what a trainer could use)."""
    import torch

    return torch.cuda.mem_get_info(0)[0] / 2**30


def watch(case: str, label: str) -> Callable[[Any], None]:
    """A refit watcher that prints each record after the first 3 s, and a failure at once
    (phase, bytes, ranks): where a refit that stalls stopped."""
    started = time.monotonic()

    def show(refit: Any) -> None:
        elapsed = time.monotonic() - started
        if elapsed < 3.0 and (not refit.terminal or refit.state.value == "COMMITTED"):
            return
        ranks = ", ".join(
            f"{r.member_id[:6]} {r.bytes_sent + r.bytes_received}/{r.bytes_total} "
            f"{r.tensors_verified}/{r.tensors_total}"
            for r in refit.ranks
        )
        print(
            f"[{case}] {label} +{elapsed:.1f} s: {refit.state.value} "
            f"{refit.bytes_done}/{refit.bytes_total} B {refit.reason} {refit.message[:300]} "
            f"[{ranks}]",
            flush=True,
        )

    return show


def optimizer_step(world: World, steps: list[Any], seed: int) -> None:
    """The trainer's synthetic optimizer step (1 % of the elements flipped), kept in `steps`
    (what every live box must then hold)."""
    step = ("flip", 0.01, seed)
    world.ask("trainer-0", ("step", step), "step")
    steps.append(step)


def our_refit(
    world: World, steps: list[Any], label: str, seed: int
) -> tuple[RefitResult, dict[str, float], dict[str, Any]]:
    """An optimizer step, our refit, the receiver's parts of it, every live box compared."""
    optimizer_step(world, steps, seed)
    result = world.refit(120.0, watch("refit", label))
    return result, receiver_parts(world), check_boxes(world, steps)


def refits(
    world: World, steps: list[Any], label: str, repeats: int, seed0: int, sleep_level: int = 0
) -> dict[str, Any]:
    """`repeats` times: (vLLM to sleep,) an optimizer step, a refit, every live box compared."""
    from refitplane.testing.refit_world.replica import sleep_engine

    results, checks, freed, receiver = [], [], [], []
    for i in range(repeats):
        if sleep_level:
            awake = free_gib()
            asleep = world.ask("replica-0", ("call", (sleep_engine, [sleep_level])), "call")
            freed.append(round(free_gib() - awake, 2) if asleep else 0.0)
        result, parts, check = our_refit(world, steps, label, seed0 + i)
        results.append(result)
        receiver.append(parts)
        checks.append(check)
    row = make_row(label, results, checks, receiver)
    if sleep_level:
        row["sleep_level"] = sleep_level
        row["freed_gib_while_asleep"] = freed
    return row
