"""The fresh-load oracle of `test_fresh_load_gpu.py` as one command for a short GPU window:
it writes a case's checkpoint once, starts a fresh `LLM` on it (kernel tensors and served
output kept: `snapshot_fresh`), stops it, starts an `LLM` from dummy weights that gets the
checkpoint through the engine's receive path (`receive_checkpoint`: mode auto = live fast
path + fallback, or staged), and prints every difference from the fresh load as soon as it
is known, then one verdict line. Exit status 1 on a difference.

    python3 tests/gpu/fresh_load_probe.py nemotron-h --mode auto --routed-experts 16

`--routed-experts` shrinks the zoo cases' expert count (the checkpoint of the full
Nemotron-3-Nano shape alone takes about a minute to write); every other shape is the case's.
The checkpoint goes under the system's temporary directory and is removed afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def probe(case: str, mode: str, config: dict[str, Any]) -> int:
    from tests.gpu.test_model_coverage_gpu import _checkpoint, _vllm
    from tests.gpu.vllm_case import NEW_TOKENS, PROMPT
    from tests.support.fresh_load import (
        differences_from_fresh,
        kernel_tensors,
        served_output,
        snapshot_fresh,
    )
    from tests.support.vllm_checks import receive_checkpoint

    began = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {case} ({mode}): {line}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="refit-fresh-load-probe-"))
    try:
        model_dir, extra = _checkpoint(case, root / case, **config)
        say(f"checkpoint written ({config or 'the case shape'})")
        with _vllm(model_dir, load_format="auto", **extra) as llm:
            say("fresh engine ready")
            fresh = snapshot_fresh(llm, model_dir, PROMPT, NEW_TOKENS)
        say(f"fresh load: {len(fresh.tensors[0])} kernel tensors, tokens {fresh.output.tokens}")
        with _vllm(model_dir, **extra) as llm:
            say("dummy engine ready")
            (report,) = llm.collective_rpc(receive_checkpoint, args=(str(model_dir), mode))
            say(f"received: {report['mode']}, {report['summary']}")
            for reason in report["fallback"]:
                say(f"fallback: {reason}")
            output = served_output(llm, PROMPT, NEW_TOKENS)
            tensors = llm.collective_rpc(kernel_tensors)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failures = differences_from_fresh(fresh, tensors, output)
    for failure in failures:
        say(failure)
    compared = len(fresh.tensors[0]) - len(fresh.runtime)
    verdict = "EQUAL to" if not failures else f"{len(failures)} difference(s) from"
    say(
        f"{verdict} the fresh load: {compared} kernel tensors per rank compared "
        f"({len(fresh.runtime)} runtime left out), tokens {output.tokens} vs {fresh.output.tokens}"
    )
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=["nemotron-h", "deepseek-v2-lite", "qwen3-fp8-kv"])
    parser.add_argument("--mode", default="auto", choices=["auto", "staged"])
    parser.add_argument("--routed-experts", type=int, default=0, help="0: the case's own")
    args = parser.parse_args()
    config = {"n_routed_experts": args.routed_experts} if args.routed_experts else {}
    return probe(args.case, args.mode, config)


if __name__ == "__main__":
    sys.exit(main())
