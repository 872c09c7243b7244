"""vLLM's own `ipc` engine on a refit world's colocated replica (`ipc_refit.py`'s peer in
the same run): one refit at a time through it, after the same synthetic optimizer step as
ours, end to end and byte-compared; alone after our rows, or interleaved with ours refit
for refit."""

from __future__ import annotations

import statistics
import time
from typing import Any

from ipc_rows import check_boxes, make_row, optimizer_step, our_refit

from refitplane.testing.refit_world.world import World


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:2000]}"


def vllm_ipc_refit(world: World, steps: list[Any], seed: int) -> dict[str, Any]:
    """One refit through vLLM's `ipc` engine on the same replica and trainer: an optimizer
    step, then the trainer hands out one CUDA IPC handle per (whole) tensor, the worker
    rebuilds them and runs `load_weights` (`worker_probes.vllm_ipc_receive`), and the
    engine's prefix cache is cleared — what a colocated RL loop must do after loading
    weights so that no prompt is served from keys and values of the old ones (TRL's GRPO
    trainer calls `llm.reset_prefix_cache()` there; our refit clears it at its pause). End
    to end: handles asked → cache cleared; then whether its loader wrote into the parameters
    or replaced them (the byte compare reads the old memory then) and the byte compare.
    vLLM 0.26's module imports Ray for its trainer side only (`import_without_ray`)."""
    from refitplane.testing.refit_world.replica import clear_prefix_cache
    from refitplane.testing.refit_world.worker_probes import stale_views, vllm_ipc_receive

    optimizer_step(world, steps, seed)
    started = time.monotonic()
    info = world.ask("trainer-0", ("ipc_handles", None), "ipc_handles")
    seconds = world.ask("replica-0", ("rpc", (vllm_ipc_receive, [info])), "rpc")
    received = time.monotonic()
    if not world.ask("replica-0", ("call", (clear_prefix_cache, [])), "call"):
        raise RuntimeError("vLLM did not clear its prefix cache after its ipc engine's refit")
    total = time.monotonic() - started
    return {
        "total_s": total,
        "clear_s": total - (received - started),
        "receive_s": max(seconds),
        "handles_s": info["seconds"],
        "stale": world.ask("replica-0", ("rpc", (stale_views, [])), "rpc")[0],
        "check": check_boxes(world, steps),
    }


def vllm_ipc_summary(refits: list[dict[str, Any]], limit_s: float, label: str) -> dict[str, Any]:
    out = {
        "total_s": [r["total_s"] for r in refits],
        "receive_s": [r["receive_s"] for r in refits],
        "clear_s": [r["clear_s"] for r in refits],
        "handles_s": [r["handles_s"] for r in refits],
        "total_median_s": statistics.median(r["total_s"] for r in refits),
        "receive_median_s": statistics.median(r["receive_s"] for r in refits),
        "exact": all(r["check"]["exact"] for r in refits),
        # The boxes that differ after each of its refits (first 5 each): who is wrong.
        "failures": [r["check"]["failures"] for r in refits],
        "stale_views": [r["stale"] for r in refits],
    }
    stale = out["stale_views"]
    print(
        f"[colocated] {label}: end to end {out['total_median_s']:.3f} s (of it the prefix "
        f"cache's clearing {statistics.median(out['clear_s']) * 1e3:.1f} ms), receive + "
        f"load_weights {out['receive_median_s']:.3f} s ({out['receive_median_s'] / limit_s:.2f}x "
        f"the copy limit), exact={out['exact']} {out['failures'] if not out['exact'] else ''} "
        f"registered views no longer in the model: {stale[-1] if stale else '?'}",
        flush=True,
    )
    return out


def vllm_ipc_baseline(
    world: World, steps: list[Any], repeats: int, limit_s: float
) -> dict[str, Any]:
    """vLLM's `ipc` engine on the same replica and trainer, `repeats` refits after one first
    use (imports, first mapping of every allocation), after ours."""
    try:
        vllm_ipc_refit(world, steps, 900)
        refits = [vllm_ipc_refit(world, steps, 901 + i) for i in range(repeats)]
    except Exception as exc:  # noqa: BLE001 - the refit rows still stand
        return {"error": error_text(exc)}
    return vllm_ipc_summary(refits, limit_s, "vLLM ipc engine")


def interleaved(
    world: World, steps: list[Any], repeats: int, limit_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ours and vLLM's `ipc` engine refit for refit in turn (after one first use of its
    engine), so both meet the same host and GPU conditions: its own time moves 53-90 ms
    between refits of one run (sixteenth session). Returns our row and its summary, with
    each pair's ratio."""
    vllm_ipc_refit(world, steps, 950)
    results, checks, receiver, theirs = [], [], [], []
    for i in range(repeats):
        result, parts, check = our_refit(world, steps, "ipc interleaved", 960 + 2 * i)
        results.append(result)
        receiver.append(parts)
        checks.append(check)
        theirs.append(vllm_ipc_refit(world, steps, 961 + 2 * i))
    row = make_row("ipc interleaved with vLLM's ipc engine", results, checks, receiver)
    summary = vllm_ipc_summary(theirs, limit_s, "vLLM ipc engine, interleaved")
    ratios = [t["total_s"] / r.seconds for t, r in zip(theirs, results, strict=True)]
    summary["pair_ratios"] = [round(x, 2) for x in ratios]
    summary["ratio_of_medians"] = summary["total_median_s"] / row["total_median_s"]
    print(
        f"[colocated] interleaved: ours {row['total_median_s'] * 1e3:.1f} ms vs vLLM's ipc engine "
        f"{summary['total_median_s'] * 1e3:.1f} ms = {summary['ratio_of_medians']:.2f}x; per pair "
        f"{summary['pair_ratios']} (median {statistics.median(ratios):.2f}x)",
        flush=True,
    )
    return row, summary
