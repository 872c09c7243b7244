"""The fresh-load oracle of `test_fresh_load_gpu.py`, one vLLM engine per process, so that a
case's fresh load and its receive start at the same time (on two GPUs, or side by side on
one) and a GPU window holds twice the cases:

    python3 tests/gpu/fresh_load_probe.py fresh nemotron-h out/          # out/fresh.pkl
    python3 tests/gpu/fresh_load_probe.py receive nemotron-h out/ auto   # out/receive-auto.pkl
    python3 tests/gpu/fresh_load_probe.py compare nemotron-h out/ auto   # exit 1 on a difference

`fresh`: a fresh `LLM` loads the case's checkpoint (`load_format="auto"`) and its kernel
tensors and served output are kept (`snapshot_fresh`). `receive`: an `LLM` from dummy
weights gets the checkpoint through the engine's receive path (`receive_checkpoint`, mode
auto = live fast path + fallback, or staged), then its kernel tensors and served output are
kept. `compare` prints every difference (`differences_from_fresh`) and the receive report.
Each process writes the case's checkpoint itself (deterministic: seed 3) in its own folder
under the system's temporary directory (gigabytes: never under `out`, whose files are kept).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
from pathlib import Path


def _checkpoint_dir(case: str, role: str) -> Path:
    return Path(tempfile.gettempdir()) / "refit-fresh-load-probe" / case / role


def _fresh(case: str, out: Path, memory: float) -> None:
    from tests.gpu.test_model_coverage_gpu import _checkpoint, _vllm
    from tests.gpu.vllm_case import NEW_TOKENS, PROMPT
    from tests.support.fresh_load import snapshot_fresh

    model_dir, extra = _checkpoint(case, _checkpoint_dir(case, "fresh"))
    with _vllm(model_dir, load_format="auto", gpu_memory_utilization=memory, **extra) as llm:
        fresh = snapshot_fresh(llm, model_dir, PROMPT, NEW_TOKENS)
    (out / "fresh.pkl").write_bytes(pickle.dumps(fresh))


def _receive(case: str, out: Path, mode: str, memory: float) -> None:
    from tests.gpu.test_model_coverage_gpu import _checkpoint, _vllm
    from tests.gpu.vllm_case import NEW_TOKENS, PROMPT
    from tests.support.fresh_load import kernel_tensors, served_output
    from tests.support.vllm_checks import receive_checkpoint

    model_dir, extra = _checkpoint(case, _checkpoint_dir(case, mode))
    with _vllm(model_dir, gpu_memory_utilization=memory, **extra) as llm:
        (report,) = llm.collective_rpc(receive_checkpoint, args=(str(model_dir), mode))
        output = served_output(llm, PROMPT, NEW_TOKENS)
        tensors = llm.collective_rpc(kernel_tensors)
    received = {"report": report, "output": output, "tensors": tensors}
    (out / f"receive-{mode}.pkl").write_bytes(pickle.dumps(received))


def _compare(case: str, out: Path, mode: str) -> int:
    from tests.support.fresh_load import differences_from_fresh

    fresh = pickle.loads((out / "fresh.pkl").read_bytes())
    received = pickle.loads((out / f"receive-{mode}.pkl").read_bytes())
    report = received["report"]
    print(f"{case} ({mode}): {report['mode']}, {report['summary']}")
    for reason in report["fallback"]:
        print(f"{case} ({mode}): fallback: {reason}")
    failures = differences_from_fresh(fresh, received["tensors"], received["output"])
    for failure in failures:
        print(f"{case} ({mode}): {failure}")
    tokens = (fresh.output.tokens, received["output"].tokens)
    compared = len(fresh.tensors[0]) - len(fresh.runtime)
    verdict = "EQUAL to" if not failures else f"{len(failures)} difference(s) from"
    print(
        f"{case} ({mode}): {verdict} the fresh load ({compared} tensors per rank; tokens {tokens})"
    )
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["fresh", "receive", "compare"])
    parser.add_argument("case", choices=["nemotron-h", "deepseek-v2-lite", "qwen3-fp8-kv"])
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", nargs="?", default="auto", choices=["auto", "staged"])
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=0.6,
        help="vLLM gpu_memory_utilization (two engines on one GPU: 0.4 each)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "fresh":
        _fresh(args.case, args.out, args.gpu_memory)
        return 0
    if args.step == "receive":
        _receive(args.case, args.out, args.mode, args.gpu_memory)
        return 0
    return _compare(args.case, args.out, args.mode)


if __name__ == "__main__":
    sys.exit(main())
