"""The fresh-load oracle of `test_fresh_load_gpu.py` as one command for a short GPU window:
it writes a case's checkpoint once, starts a fresh `LLM` on it (kernel tensors and served
output kept: `snapshot_fresh`), stops it, starts an `LLM` from dummy weights that gets the
checkpoint through the engine's receive path (`receive_checkpoint`: mode auto = live fast
path + fallback, or staged), and prints every difference from the fresh load as soon as it
is known, then one verdict line. Exit status 1 on a difference. Several modes share the
checkpoint and the fresh load (one dummy engine per mode: each receive starts from dummy
weights, so nothing a mode leaves stale is hidden by the one before).

    python3 tests/gpu/fresh_load_probe.py nemotron-h --mode auto staged --routed-experts 16

`--unfolded-first` (FP8 KV-cache scales, issue 28): the dummy engine first receives with the
refit's re-fold of attention KV-cache scales switched off (`vllm_kv_scales`), which shows
what vLLM's own layerwise reload leaves there, then receives again as a refit does; the
scales of the first attention layer are printed at every step.

`--routed-experts` shrinks the zoo cases' expert count (the checkpoint of the full
Nemotron-3-Nano shape alone takes about a minute to write); every other shape is the case's.
The checkpoint goes under the system's temporary directory and is removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def attention_scales(worker: Any) -> dict[str, Any]:
    """In a worker: the folded KV-cache scales of the first attention layer (the values the
    kernels read), and whether vLLM still computes them from activations."""
    model = worker.model_runner.get_model()
    for path, module in model.named_modules():
        if hasattr(module, "_k_scale"):
            values = {
                name: float(getattr(module, name))
                for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale", "_k_scale_cpu")
                if getattr(module, name, None) is not None
            }
            values["calculate_kv_scales"] = bool(getattr(module, "calculate_kv_scales", False))
            return {"layer": path, **values}
    return {}


def kv_fold(worker: Any, on: bool) -> bool:
    """In a worker: switch the refit's re-fold of KV-cache scales off (a no-op in its place)
    or back on, for `--unfolded-first`."""
    from refitplane.generator import vllm_kv_scales, vllm_staging

    vllm_staging.fold_attention_scales = (  # type: ignore[assignment]
        vllm_kv_scales.fold_attention_scales if on else (lambda *args: 0)
    )
    return on


def probe(case: str, modes: list[str], config: dict[str, Any], unfolded_first: bool = False) -> int:
    from tests.gpu.test_model_coverage_gpu import _checkpoint, _vllm
    from tests.gpu.vllm_case import NEW_TOKENS, PROMPT
    from tests.support.fresh_load import snapshot_fresh

    began = time.monotonic()

    def say(line: str, mode: str = "fresh") -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {case} ({mode}): {line}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="refit-fresh-load-probe-"))
    try:
        model_dir, extra = _checkpoint(case, root / case, **config)
        say(f"checkpoint written ({config or 'the case shape'})")
        with _vllm(model_dir, load_format="auto", **extra) as llm:
            say("fresh engine ready")
            fresh = snapshot_fresh(llm, model_dir, PROMPT, NEW_TOKENS)
            say(f"scales: {llm.collective_rpc(attention_scales)[0]}")
        say(f"fresh load: {len(fresh.tensors[0])} kernel tensors, tokens {fresh.output.tokens}")
        failed = 0
        for mode in modes:
            failed += _receive_and_compare(model_dir, extra, mode, fresh, say, unfolded_first)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def _receive_and_compare(
    model_dir: Path, extra: dict[str, Any], mode: str, fresh: Any, say: Any, unfolded_first: bool
) -> int:
    """A dummy engine filled through the receive path in `mode`, compared with `fresh`;
    1 on a difference (each printed), else 0."""
    from tests.gpu.test_model_coverage_gpu import _vllm
    from tests.gpu.vllm_case import NEW_TOKENS, PROMPT
    from tests.support.fresh_load import differences_from_fresh, kernel_tensors, served_output
    from tests.support.vllm_checks import receive_checkpoint

    with _vllm(model_dir, **extra) as llm:
        say("dummy engine ready", mode)
        say(f"scales: {llm.collective_rpc(attention_scales)[0]}", mode)
        if unfolded_first:
            llm.collective_rpc(kv_fold, args=(False,))
            llm.collective_rpc(receive_checkpoint, args=(str(model_dir), mode))
            unfolded = differences_from_fresh(fresh, llm.collective_rpc(kernel_tensors), None)
            say(f"scales without the re-fold: {llm.collective_rpc(attention_scales)[0]}", mode)
            say(f"without the re-fold: {len(unfolded)} difference(s) {unfolded[:4]}", mode)
            llm.collective_rpc(kv_fold, args=(True,))
        (report,) = llm.collective_rpc(receive_checkpoint, args=(str(model_dir), mode))
        say(f"scales: {llm.collective_rpc(attention_scales)[0]}", mode)
        say(f"received: {report['mode']}, {report['summary']}", mode)
        for reason in report["fallback"]:
            say(f"fallback: {reason}", mode)
        output = served_output(llm, PROMPT, NEW_TOKENS)
        tensors = llm.collective_rpc(kernel_tensors)
        say(f"scales after generating: {llm.collective_rpc(attention_scales)[0]}", mode)
    failures = differences_from_fresh(fresh, tensors, output)
    for failure in failures:
        say(failure, mode)
    compared = len(fresh.tensors[0]) - len(fresh.runtime)
    verdict = "EQUAL to" if not failures else f"{len(failures)} difference(s) from"
    say(
        f"{verdict} the fresh load: {compared} kernel tensors per rank compared "
        f"({len(fresh.runtime)} runtime left out), tokens {output.tokens} vs "
        f"{fresh.output.tokens}",
        mode,
    )
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "case", choices=["nemotron-h", "deepseek-v2-lite", "qwen3-fp8-kv", "qwen3-moe-fp8"]
    )
    parser.add_argument(
        "--mode", nargs="+", default=["auto"], choices=["auto", "live", "layerwise", "staged"]
    )
    parser.add_argument(
        "--unfolded-first",
        action="store_true",
        help="receive once without the KV-scale re-fold first (shows what vLLM's reload leaves)",
    )
    parser.add_argument("--routed-experts", type=int, default=0, help="0: the case's own")
    args = parser.parse_args()
    config = {"n_routed_experts": args.routed_experts} if args.routed_experts else {}
    return probe(args.case, args.mode, config, args.unfolded_first)


if __name__ == "__main__":
    code = main()
    # Every engine has stopped by now; on a GPU machine the interpreter's own exit has hung
    # past the verdict until the window's timeout (2026-11-26 WA), so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
