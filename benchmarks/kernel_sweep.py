"""What the one-GPU kernel benchmarks (`delta_scan_gpu.py`, `copy_sums_gpu.py`) share: their
command line, and a sweep that runs each launch shape in a process of its own (the kernels
read their shape from the environment at import) and prints its row as it comes."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The shared arguments; a benchmark adds its own before parsing."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--model", default="qwen3-8b")
    out.add_argument("--repeats", type=int, default=repeats)
    out.add_argument("--sweep", action="store_true")
    out.add_argument("--rows", type=int, nargs="*", help="which rows of SWEEP (default all)")
    out.add_argument("--device", default="cuda:0")
    out.add_argument("--json", action="store_true", help="print one JSON line (sweep rows)")
    out.add_argument("--out", type=Path)
    return out


def sweep(
    script: str,
    shapes: Sequence[Mapping[str, str]],
    arguments: Sequence[str],
    head: Callable[[dict[str, Any]], None],
    row: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """Run `script --json ARGUMENTS` once per shape (its environment settings), print the
    head before the first row and each row as it comes (a device window may end first)."""
    import os

    results: list[dict[str, Any]] = []
    for shape in shapes:
        command = [sys.executable, script, "--json", *arguments]
        done = subprocess.run(
            command, env={**os.environ, **shape}, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            print(f"{dict(shape)}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if len(results) == 1:
            head(results[0])
        print(row(results[-1]), flush=True)
    return results


def write(path: Path | None, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    if path is not None:
        meta = {"host": platform.node(), **meta}
        path.write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
