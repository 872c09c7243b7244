#!/usr/bin/env python3
"""How fast a sender's delta kernels read memory on one GPU, per launch shape: what the scan
costs against the copy that moves the same bytes.

    python benchmarks/delta_scan_gpu.py --model qwen3-8b --fraction 0.01 [--sweep] [--out r.json]

The trainer TP1 rank's tensors of `--model` (synthetic bf16 on cuda:0, one message per
tensor) and a base that differs in `--fraction` of the elements. Timed with CUDA events,
median of `--repeats` after a warm-up:

- copy: `torch._foreach_copy_` of every current tensor (reads and writes the bytes once:
  the scan reads current and base once, the same traffic, so this is its bound);
- scan: `delta_batch.scan_many` as a sender runs it (base advanced where changed, checksum
  rows added) — the base is restored before each run, outside the timing;
- scan, no sums: the same without the checksum rows;
- gather: every payload written (`prepare_gather` + one launch) after the scan — with slots
  (REFIT_DELTA_PACK_CAP), `pack` from the scan's slots and the gather for what overflowed;
- sample: `sample_changed`, the "auto" estimate before a scan.

Every payload is checked against the torch encoding (`delta.encode_into`) of the same
bytes, outside the timing: a launch shape that writes other bytes fails its row.

`--sweep` runs the shapes of `SWEEP` (REFIT_DELTA_SCAN_BLOCK words per program,
REFIT_DELTA_SCAN_WARPS warps, REFIT_DELTA_SCAN_SUMS: the checksum sums from the block loaded
again as 64-bit words or from the words already loaded, REFIT_DELTA_SCAN_UPDATE: the base
advanced word by word or row by row, REFIT_DELTA_PACK_CAP: slots per block for the scan's
compaction, 0 none, REFIT_DELTA_SUM_STRIPES: rows each message's checksum sums are spread
over), each in a process of its own (read at import), and prints one row each; the first row
is the default. `--rows 0 1` runs those rows of it only.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

# (words per program, warps per program, checksum sums, base update, slots per block, sum
# stripes): the default first, then the sums striped (their atomics queue on two words per
# message otherwise), then the scan's compaction (`pack`) at three shapes (registers per
# thread on sm_90 without / with slots, `tests/unit/reshard/test_kernel_registers.py`'s way:
# 4096 words and 4 warps 67 / 71, 8 warps 56 / 55, 2048 words and 4 warps 47 / 54), then the
# earlier sweep's shapes.
SWEEP = (
    (4096, 4, "reload", "rows", 0, 1),
    (4096, 4, "reload", "rows", 0, 32),
    (4096, 4, "words", "rows", 0, 32),
    (4096, 4, "reload", "rows", 64, 32),
    (4096, 8, "reload", "rows", 64, 32),
    (4096, 8, "reload", "rows", 0, 32),
    (2048, 4, "reload", "rows", 32, 32),
    (2048, 4, "reload", "rows", 0, 32),
    (4096, 4, "reload", "rows", 64, 1),
    (4096, 4, "words", "rows", 0, 1),
    (4096, 4, "reload", "words", 0, 1),
)


def _measure(model: str, fraction: float, repeats: int, device_name: str) -> dict[str, Any]:
    import time

    import torch

    from refitplane.reshard import delta_batch, delta_kernels
    from refitplane.reshard.checksum import accumulate_sums
    from refitplane.reshard.delta import Encoding, choose_encoding, encode_into
    from refitplane.testing.model_layouts import GPU_LAYOUTS, model_layouts

    sys.path.insert(0, str(Path(__file__).parent))
    from model_refit import _shards

    device = torch.device(device_name)  # cpu: a smoke test, in Triton's interpreter
    source, _ = model_layouts(model, GPU_LAYOUTS["tp1"])
    shards = _shards(source, 0, device, fill=True)
    currents = [sv.tensor.view(-1).view(torch.uint8) for sv in shards]
    originals = [c.clone() for c in currents]
    gen = torch.Generator(device=device).manual_seed(7)
    for c in currents:
        words = c.view(torch.int16)
        words[torch.rand(words.numel(), device=device, generator=gen) < fraction] ^= 1
    bases = [o.clone() for o in originals]
    rows = torch.zeros((len(currents), 2), dtype=torch.int64, device=device)
    nbytes = sum(c.numel() for c in currents)

    on_cuda = device.type == "cuda"

    def timed(run: Any, before: Any = None) -> float:
        times = []
        for _ in range(repeats + 1):
            if before is not None:
                before()
            if not on_cuda:
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
                continue
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times[1:])

    def restore() -> None:
        torch._foreach_copy_(bases, originals)
        rows.zero_()

    def scan(sums: bool) -> Any:
        return delta_batch.scan_many(
            currents,
            bases,
            2,
            update=True,
            sums=[rows[i] for i in range(len(currents))] if sums else None,
        )

    copy_s = timed(lambda: torch._foreach_copy_(bases, currents))  # (restored below)
    scan_s = timed(lambda: scan(True), restore)
    plain_s = timed(lambda: scan(False), restore)
    restore()
    batch = scan(True)
    counts = [int(n) for n in batch.counts.tolist()]
    exact = [
        int((c.view(torch.int16) != o.view(torch.int16)).sum())
        for c, o in zip(currents, originals, strict=True)
    ]
    if counts != exact:
        raise SystemExit(f"block {delta_kernels.BLOCK}: the scan's counts differ from torch's")
    for i, (current, summed) in enumerate(zip(currents, batch.summed, strict=True)):
        want = torch.zeros(2, dtype=torch.int64, device=device)
        accumulate_sums(current, want)
        if summed and not torch.equal(rows[i], want):
            raise SystemExit(
                f"{delta_kernels.SCAN_SUMS} sums of message {i} differ from the checksum's"
            )
    headers = [choose_encoding(c.numel(), n, 2) for c, n in zip(currents, counts, strict=True)]
    # One zeroed arena, a payload per sparse message, each at a multiple of 16 bytes (as
    # `DeltaExchange.encode` lays them: the gather writes whole words, and unaligned cuts
    # fail with "misaligned address", as this benchmark's first GPU run did).
    offsets, total = [], 0
    for h in headers:
        offsets.append(total)
        if h.encoding is not Encoding.DENSE:
            total += (h.nbytes + 15) // 16 * 16
    arena = torch.zeros(total, dtype=torch.uint8, device=device)
    payloads = [
        None if h.encoding is Encoding.DENSE else arena[at : at + h.nbytes]
        for h, at in zip(headers, offsets, strict=True)
    ]
    gather = delta_batch.prepare_gather(batch, headers, payloads)
    gather_s = timed(gather.launch) if gather is not None else 0.0
    for i, (header, payload) in enumerate(zip(headers, payloads, strict=True)):
        if payload is None:
            continue
        want = torch.empty_like(payload)
        encode_into(currents[i], originals[i], header, 2, want)
        if not torch.equal(payload, want):
            raise SystemExit(f"message {i} ({header}): the gather's payload differs from torch's")
    restore()
    sample_s = timed(lambda: delta_batch.sample_changed(currents, bases, 2))
    changed = sum(counts)
    return {
        "block": delta_kernels.BLOCK,
        "warps": delta_kernels.SCAN_WARPS,
        "sums": delta_kernels.SCAN_SUMS,
        "update": delta_kernels.SCAN_UPDATE,
        "slots": delta_kernels.PACK_CAP,
        "stripes": delta_kernels.SUM_STRIPES,
        "overflow_blocks": int(batch.overflow) if batch.overflow is not None else 0,
        "blocks": batch.blocks.count,
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor(),
        "messages": len(currents),
        "bytes": nbytes,
        "changed_words": changed,
        "encodings": {e.name: sum(h.encoding is e for h in headers) for e in Encoding},
        "copy_s": copy_s,
        "scan_s": scan_s,
        "scan_no_sums_s": plain_s,
        "gather_s": gather_s,
        "sample_s": sample_s,
    }


def _row(r: dict[str, Any]) -> str:
    read = 2 * r["bytes"] / 1e9  # both images (the copy: read + write)
    passes = [
        f"{r[k] * 1e3:.1f} ({read / r[k]:.0f})" for k in ("copy_s", "scan_s", "scan_no_sums_s")
    ]
    cells = [str(r["block"]), str(r["warps"]), f"{r['sums']}, {r.get('stripes', 1)} stripes"]
    cells.append(r.get("update", "words"))
    slots = r.get("slots", 0)
    cells.append(f"{slots} ({r.get('overflow_blocks', 0)} over)" if slots else "—")
    cells += [*passes, f"{r['gather_s'] * 1e3:.1f}", f"{(r['scan_s'] + r['gather_s']) * 1e3:.1f}"]
    cells.append(f"{r['sample_s'] * 1e3:.2f}")
    return "| " + " | ".join(cells) + " |"


def _print_head(first: dict[str, Any], model: str, fraction: float) -> None:
    print(
        f"{first['device']}, {model}: {first['messages']} messages, "
        f"{first['bytes'] / 1e9:.2f} GB, {fraction:.2%} changed "
        f"({first['changed_words']} words; {first['encodings']}); ms (GB/s over both images)"
    )
    print(
        "| words/program | warps | sums | update | slots/block | copy | scan | scan, no sums "
        "| gather | scan + gather | sample |"
    )
    print("|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|", flush=True)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import kernel_sweep

    parser = kernel_sweep.parser(__doc__, repeats=5)
    parser.add_argument("--fraction", type=float, default=0.01)
    args = parser.parse_args()
    if not args.sweep:
        result = _measure(args.model, args.fraction, args.repeats, args.device)
        if args.json:
            print(json.dumps(result))
            return
        _print_head(result, args.model, args.fraction)
        print(_row(result))
        results = [result]
    else:
        picked = SWEEP if args.rows is None else [SWEEP[i] for i in args.rows]
        shapes = [
            {
                "REFIT_DELTA_SCAN_BLOCK": str(block),
                "REFIT_DELTA_SCAN_WARPS": str(warps),
                "REFIT_DELTA_SCAN_SUMS": sums,
                "REFIT_DELTA_SCAN_UPDATE": update,
                "REFIT_DELTA_PACK_CAP": str(slots),
                "REFIT_DELTA_SUM_STRIPES": str(stripes),
            }
            for block, warps, sums, update, slots, stripes in picked
        ]
        arguments = ["--model", args.model, "--device", args.device]
        arguments += ["--fraction", str(args.fraction), "--repeats", str(args.repeats)]
        results = kernel_sweep.sweep(
            __file__,
            shapes,
            arguments,
            lambda first: _print_head(first, args.model, args.fraction),
            _row,
        )
    kernel_sweep.write(args.out, {"model": args.model, "fraction": args.fraction}, results)


if __name__ == "__main__":
    main()
