#!/usr/bin/env python3
"""What a delta costs to find and apply: `refitplane.reshard.delta` on one device.

For one message of `--mib` MiB of bf16 with a fraction of its elements changed, times
(median of `--repeats`, after a warm-up):

- count: words that differ from the base (the detection pass; one read of both images);
- encode: the payload in the encoding `choose_encoding` picks;
- apply: the payload applied in place to a copy of the base;

and the payload size against the dense message. Every apply is checked byte for byte.
The time a delta saves on the wire is (dense - payload) / link bandwidth; the detection and
encoding cost is what it must beat.

    python benchmarks/delta_codec.py [--device cuda] [--mib 256] [--fractions 0.001 0.01 0.05 0.2 0.5]

On CUDA the Triton kernels (`delta_triton`) run; REFIT_DELTA_KERNELS=torch runs the torch
ops instead, for comparison in the same session.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from refitplane.reshard.delta import (
    apply_delta,
    changed_words,
    choose_encoding,
    encode_into,
)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` (synchronised on CUDA)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(device: torch.device, mib: int, fraction: float, repeats: int) -> dict[str, float]:
    g = torch.Generator(device="cpu").manual_seed(0)
    numel = mib * 2**20 // 2
    base_values = torch.randn(numel, generator=g).to(torch.bfloat16)
    current_values = base_values.clone()
    picked = torch.rand(numel, generator=g) < fraction
    current_values[picked] += 0.5
    base = base_values.view(torch.uint8).to(device)
    current = current_values.view(torch.uint8).to(device)
    word = 2
    changed = int(changed_words(current, base, word))
    header = choose_encoding(current.numel(), changed, word)
    payload = torch.empty(header.nbytes, dtype=torch.uint8, device=device)
    received = base.clone()

    def apply() -> None:
        received.copy_(base)
        apply_delta(received, header, word, payload)

    count_s = _timed(lambda: changed_words(current, base, word), device, repeats)
    encode_s = _timed(lambda: encode_into(current, base, header, word, payload), device, repeats)
    copy_s = _timed(lambda: received.copy_(base), device, repeats)
    apply_s = max(0.0, _timed(apply, device, repeats) - copy_s)
    if not torch.equal(received, current):
        raise SystemExit(f"delta at {fraction:.3%} did not reproduce the current bytes")
    return {
        "fraction": fraction,
        "changed_words": changed,
        "encoding": header.encoding.name,
        "payload_ratio": header.nbytes / current.numel(),
        "count_ms": 1e3 * count_s,
        "encode_ms": 1e3 * encode_s,
        "apply_ms": 1e3 * apply_s,
        "count_gbps": 2 * current.numel() / count_s / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.001, 0.01, 0.05, 0.2, 0.5])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    kernels = "torch" if os.environ.get("REFIT_DELTA_KERNELS") == "torch" else "triton"
    if device.type != "cuda":
        kernels = "torch"
    print(f"{args.mib} MiB bf16 message on {name}, torch {torch.__version__}, {kernels} kernels")
    print(
        f"{'changed':>8} {'encoding':>8} {'payload':>8} {'count ms':>9} {'GB/s':>6} "
        f"{'encode ms':>10} {'apply ms':>9}"
    )
    rows = []
    for fraction in args.fractions:
        row = measure(device, args.mib, fraction, args.repeats)
        rows.append(row)
        print(
            f"{fraction:>8.1%} {row['encoding']:>8} {row['payload_ratio']:>8.3f} "
            f"{row['count_ms']:>9.2f} {row['count_gbps']:>6.0f} {row['encode_ms']:>10.2f} "
            f"{row['apply_ms']:>9.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "mib": args.mib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
