#!/usr/bin/env python3
"""The CUDA IPC receiver's copy that checksums (`copy_sums.py`) against the device's copy limit.

    python benchmarks/copy_sums_gpu.py --model qwen3-8b [--sweep] [--out r.json]

On one GPU, for a model shape's parameters (Qwen3-8B: 399 tensors, 16.4 GB; the trainer's
synthetic shards, as `model_refit.py` makes them), the time of:
  * copy limit — one `copy_` of a single buffer of the same bytes (what issue 27's "device
    copy limit" is measured against, `ipc_refit.py`'s first line);
  * per-tensor copy — `torch._foreach_copy_` of every tensor (the receiver's unfused path
    without its checksums);
  * copy + sums — one `CopySums.launch` over every tensor: copied and checksummed, the
    receiver's fused path (every byte's sums checked against `checksum.py`'s afterwards).
Each is the mean of `--repeats` back-to-back runs between two CUDA events, after a warm-up.

`--sweep` runs the launch shapes of `SWEEP` (REFIT_COPY_SUMS_BLOCK words per step,
REFIT_COPY_SUMS_ITERS steps per program, REFIT_COPY_SUMS_WARPS warps), each in a process of
its own (the shape is read at import), one row each; the first row is the default.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (words per step, steps per program, warps): the default first.
_SHAPE = ("BLOCK", "ITERS", "WARPS")
SWEEP = (
    (1024, 16, 4),
    (1024, 4, 4),
    (1024, 1, 4),
    (2048, 8, 8),
    (4096, 4, 8),
    (4096, 1, 8),
    (512, 16, 2),
    (2048, 16, 4),
    (1024, 64, 4),
)


def _measure(model: str, repeats: int, device_name: str) -> dict[str, Any]:
    import torch

    from refitplane.reshard import copy_sums
    from refitplane.reshard.checksum import accumulate_sums
    from refitplane.testing.model_layouts import GPU_LAYOUTS, model_layouts

    sys.path.insert(0, str(Path(__file__).parent))
    from model_refit import _shards

    device = torch.device(device_name)
    source, _ = model_layouts(model, GPU_LAYOUTS["tp1"])
    shards = _shards(source, 0, device, fill=True)
    sources = [sv.tensor.view(-1).view(torch.uint8) for sv in shards]
    targets = [torch.empty_like(s) for s in sources]
    nbytes = sum(s.numel() for s in sources)
    rows = torch.zeros((len(sources), 2), dtype=torch.int64, device=device)
    copies = copy_sums.CopySums(list(zip(targets, sources, strict=True)), list(rows.unbind(0)))

    def mean_s(run: Any) -> float:
        run()  # warm-up (and the kernel's compile)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / repeats

    def limit_s() -> float:
        # One buffer of the same bytes each way, freed before the other passes.
        flat = torch.empty((2, nbytes), dtype=torch.uint8, device=device)
        return mean_s(lambda: flat[1].copy_(flat[0]))

    copy_limit_s = limit_s()
    foreach_s = mean_s(lambda: torch._foreach_copy_(targets, sources))
    fused_s = mean_s(copies.launch)
    # Every byte and every sum, against `copy_` and `checksum.py` (one more launch).
    for t in targets:
        t.fill_(0xA5)
    rows.zero_()
    copies.launch()
    torch.cuda.synchronize()
    for i, (src, dst) in enumerate(zip(sources, targets, strict=True)):
        want = torch.zeros(2, dtype=torch.int64, device=device)
        accumulate_sums(src, want)
        if not torch.equal(dst, src) or not torch.equal(rows[i], want):
            raise SystemExit(f"tensor {i}: the fused copy's bytes or sums differ")
    return {
        "block": copy_sums._BLOCK,
        "iters": copy_sums._ITERS,
        "warps": copy_sums._WARPS,
        "aligned": copies.aligned and copy_sums.ALIGNED,
        "device": torch.cuda.get_device_name(device),
        "tensors": len(sources),
        "bytes": nbytes,
        "programs": copies.programs,
        "copy_limit_s": copy_limit_s,
        "foreach_copy_s": foreach_s,
        "copy_sums_s": fused_s,
    }


def _row(r: dict[str, Any]) -> str:
    def cell(key: str) -> str:
        # GB/s as a copy counts it: bytes read plus bytes written.
        return f"{r[key] * 1e3:.2f} ({2 * r['bytes'] / r[key] / 1e9:.0f})"

    ratio = r["copy_sums_s"] / r["copy_limit_s"]
    shape = [str(r["block"]), str(r["iters"]), str(r["warps"]), str(r["programs"])]
    cells = [cell(k) for k in ("copy_limit_s", "foreach_copy_s", "copy_sums_s")]
    return "| " + " | ".join([*shape, *cells, f"{ratio:.2f}x"]) + " |"


def _head(first: dict[str, Any], model: str) -> None:
    print(
        f"{first['device']}, {model}: {first['tensors']} tensors, "
        f"{first['bytes'] / 1e9:.2f} GB; ms (GB/s read + written)"
    )
    print(
        "| words/step | steps | warps | programs | copy limit | per-tensor copy_ | copy + sums "
        "| vs limit |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import kernel_sweep

    args = kernel_sweep.parser(__doc__, repeats=10).parse_args()
    if args.json:
        print(json.dumps(_measure(args.model, args.repeats, args.device)))
        return
    picked = [] if not args.sweep else [SWEEP[i] for i in (args.rows or range(len(SWEEP)))]
    shapes = [
        {f"REFIT_COPY_SUMS_{name}": str(value) for name, value in zip(_SHAPE, s, strict=True)}
        for s in picked
    ]
    arguments = ["--model", args.model, "--device", args.device, "--repeats", str(args.repeats)]
    results = kernel_sweep.sweep(
        __file__, shapes or [{}], arguments, lambda first: _head(first, args.model), _row
    )
    kernel_sweep.write(args.out, {"model": args.model}, results)


if __name__ == "__main__":
    main()
