"""The fresh-load oracle of a refit world (`benchmarks/gpu_refit.py --fresh-load`): a vLLM
engine *started* from the checkpoint the world's trainers hold (`synthetic_loader`: the
synthetic weights through vLLM's own load path and post-load processing), its kernel tensors
digested (`kernel_tensors`, "sums": on the tensors' own device, one at a time) and its greedy
tokens taken, then stopped. A refitted replica is right when its own digests and tokens are
these (`differences`).

It runs in a spawned process of its own process group on the GPUs it is given (after the
refit world has stopped, on the replica's GPUs), with the replica's engine settings.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refitplane.testing.process_world import stop_process
from refitplane.testing.refit_world.replica import enter_vllm_process, llm_kwargs

# Runtime state that generation writes is never compared; a KV-cache quantization scale is
# not in a checkpoint without one (no refit sends it; vLLM keeps what its first load left).
KV_SCALES = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale")


@dataclass(frozen=True)
class FreshSpec:
    model_dir: str
    shape: str
    dtype: str
    quant: str
    tp: int
    gpus: str  # CUDA_VISIBLE_DEVICES; "" on CPU
    device: str
    prompt: tuple[int, ...]
    new_tokens: int
    gpu_memory_utilization: float = 0.45
    # The synthetic optimizer steps the trainers took since the synthetic start
    # (`synthetic_weights.Step`), replayed by the loader: the checkpoint they hold now.
    steps: tuple[tuple[str, float, int], ...] = ()


def fresh_load_digests(spec: FreshSpec, timeout_s: float = 900) -> dict[str, Any]:
    """{"tensors": [per rank: name → digest], "tokens": [...]} of a fresh engine on the
    synthetic checkpoint, or {"error": "..."} when it could not start or answer."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_fresh_main, args=(spec, results), daemon=False)
    proc.start()
    try:
        answer: dict[str, Any] = results.get(timeout=timeout_s)
    except queue.Empty:
        answer = {"error": f"the fresh engine did not answer in {timeout_s:.0f} s"}
    finally:
        stop_process(proc)
    return answer


def _fresh_main(spec: FreshSpec, results: Any) -> None:
    enter_vllm_process(spec.device, spec.tp, spec.gpus)
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from refitplane.testing.kernel_tensors import kernel_tensors
        from refitplane.testing.synthetic_loader import LOAD_FORMAT, WORKER_EXTENSION
        from refitplane.testing.vllm_cpu import shutdown_engine

        kwargs = llm_kwargs(
            spec.model_dir,
            spec.tp,
            spec.dtype,
            LOAD_FORMAT,
            spec.device,
            spec.gpu_memory_utilization,
        )
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        kwargs["model_loader_extra_config"] = {
            "shape": spec.shape,
            "dtype": spec.dtype,
            "quant": spec.quant,
            "steps": [list(step) for step in spec.steps],
        }
        llm = LLM(**kwargs)
        tensors = llm.collective_rpc(kernel_tensors, args=("sums",))
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=list(spec.prompt))],
            SamplingParams(temperature=0, max_tokens=spec.new_tokens, detokenize=False),
            use_tqdm=False,
        )
        results.put({"tensors": tensors, "tokens": list(out[0].outputs[0].token_ids)})
        shutdown_engine(llm)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"[:4000]})


def differences(
    fresh: Sequence[Mapping[str, str]], replica: Sequence[Mapping[str, str]]
) -> tuple[int, list[str]]:
    """How many kernel tensors were compared, and every one missing, extra or with other
    bytes on a rank of `replica` than on the fresh load's (KV-cache scales aside)."""
    if len(fresh) != len(replica):
        return 0, [f"{len(replica)} ranks, the fresh load has {len(fresh)}"]
    compared, failures = 0, []
    for rank, (want, got) in enumerate(zip(fresh, replica, strict=True)):
        for name in sorted(want.keys() | got.keys()):
            if name.endswith(KV_SCALES):
                continue
            if name not in got:
                failures.append(f"rank {rank}: {name} missing (fresh load: {want[name][:40]})")
            elif name not in want:
                failures.append(f"rank {rank}: {name} not in the fresh load")
            else:
                compared += 1
                if got[name] != want[name]:
                    shape = " ".join(want[name].split(" ")[:-2])  # "dtype [shape]"
                    failures.append(f"rank {rank}: {name} ({shape}) differs from the fresh load")
    return compared, failures
