"""What `gpu_refit.py` prints: per refit, where the time outside the data plane went
(`control_breakdown`), and at the end the table of its rows against the raw ceiling and
vLLM's `nccl` engine (`summary`, which also keeps the best row in the JSON)."""

from __future__ import annotations

import statistics
from typing import Any

from nccl_ceiling import per_dest_gbs


def control_breakdown(result: Any, ranks: dict[str, dict[str, float]]) -> str:
    """Where one refit's time outside the data plane went (ms): trigger -> COMMITTED minus
    the coordinator's TRANSFERRING (issue 23's "control"), its PENDING / PREPARING /
    VERIFYING, the part of TRANSFERRING that is not the slowest rank's executor (the control
    plane's start and end of the transfer: StartTransfer delivery, the sidecar's update call
    reaching the workers, the TransferDone reports), the time outside every phase (the
    trigger and the watch that saw COMMITTED); then each rank's executor wall time and each
    vLLM worker's finish_weight_update (the rest of the sidecar's "finish" is vLLM's RPC)."""
    phases = result.phases
    transferring = phases.get("TRANSFERRING", 0.0)
    slowest = max((r.get("executor", 0.0) for r in ranks.values()), default=0.0)
    parts = {
        "control": result.seconds - transferring,
        "PENDING": phases.get("PENDING", 0.0),
        "PREPARING": phases.get("PREPARING", 0.0),
        "VERIFYING": phases.get("VERIFYING", 0.0),
        "TRANSFERRING-executor": transferring - slowest if slowest else float("nan"),
        "outside phases": result.seconds - sum(phases.values()),
    }
    per_rank = [
        f"{name} {what} {seconds * 1e3:.1f}"
        for name, timings in ranks.items()
        for what, seconds in timings.items()
    ]
    return ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()) + " | " + ", ".join(per_rank)


def summary(out: dict[str, Any]) -> None:
    """Print the run's table and its best row's phases; keep the best row in `out`."""
    rows = out["ours"]["rows"]
    links: dict[tuple[int, int], int] = {}
    for key, nbytes in out["links"].items():
        src, dst = key.split(">")
        links[(int(src), int(dst))] = int(nbytes)
    best = min(rows, key=lambda r: statistics.median(r["transfer_s"]))
    data_s = statistics.median(best["transfer_s"])
    total_s = statistics.median(best["total_s"])
    print(
        f"\n{out['model']} {out['layout']} ({out['bytes'] / 2**30:.2f} GiB) on {out.get('gpu', out['device'])}"
    )
    print(
        f"  {'streams':>7} {'bucket':>7} {'direct':>7} {'staging':>8} {'data s':>8} {'total s':>8} {'GB/s/dst':>9} {'% ceil':>7} {'gen +MiB':>9} {'trn +MiB':>9} {'verified':>9}"
    )
    for r in rows:
        d = statistics.median(r["transfer_s"])
        gbs = per_dest_gbs(links, d)
        pct = 100 * out["ceiling_s"] / d if "ceiling_s" in out else float("nan")
        print(
            f"  {r['streams']:>7} {r['bucket_mib']:>5}Mi {r['direct_mib']:>5}Mi {r['inflight_mib']:>6}Mi {d:>8.3f} {statistics.median(r['total_s']):>8.3f} {gbs:>9.1f} {pct:>6.1f}% {r['generator_extra_mib']:>9.0f} {r['trainer_extra_mib']:>9.0f} {r['verified']:>9}"
        )
    phases = {
        name: statistics.median(p.get(name, 0.0) for p in best["phases"])
        for name in best["phases"][0]
    }
    print(
        "  best row's phases (median): "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items())
    )
    print(
        f"  best: data plane {data_s:.3f} s ({per_dest_gbs(links, data_s):.1f} GB/s per destination GPU), trigger→committed {total_s:.3f} s"
    )
    if "ceiling_s" in out:
        print(
            f"  raw ceiling {out['ceiling_s']:.3f} s → data plane at {100 * out['ceiling_s'] / data_s:.1f}% of it"
        )
    if "vllm_nccl" in out:
        base = statistics.median(out["vllm_nccl"]["replica_seconds"])
        print(
            f"  vLLM nccl engine {base:.3f} s per refit → refitplane (trigger→committed) is {base / total_s:.1f}x faster, data plane {base / data_s:.1f}x"
        )
    out["best"] = {
        "streams": best["streams"],
        "bucket_mib": best["bucket_mib"],
        "direct_mib": best["direct_mib"],
        "data_s": data_s,
        "total_s": total_s,
    }
