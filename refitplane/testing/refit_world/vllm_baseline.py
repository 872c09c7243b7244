"""vLLM's built-in `nccl` weight-transfer engine on the same kind of replicas: the baseline
`benchmarks/gpu_refit.py` measures refitplane against. Trainer rank 0 (GPU 0) holds every
tensor whole (its gather is not counted) and broadcasts them, packed, with vLLM's
`NCCLWeightTransferEngine.trainer_send_weights`; every worker of every replica receives one
full refit (start → update → finish), timed on the replicas.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path
from typing import Any

from refitplane.testing.model_shapes import tensor_specs, write_config
from refitplane.testing.process_world import SAFE_ENV, stop_process
from refitplane.testing.refit_world.replica import ReplicaSpec, replica_main
from refitplane.testing.refit_world.trainer import TrainerSpec
from refitplane.testing.synthetic_weights import synthetic

os.environ.update(SAFE_ENV)


def baseline_receive(llm: Any, phase: str, info: dict[str, Any]) -> Any:
    """Replica side of vLLM's `nccl` engine: `init` joins the broadcast group, `update`
    receives one full refit (start → update → finish) and returns its seconds."""
    # Straight to the workers, as vLLM 0.26's LLM verbs do (newer API-process wrappers would
    # run refitplane's flows in a replica whose configured backend is refitplane).
    if phase == "init":
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
        return None
    started = time.perf_counter()
    llm.collective_rpc("start_weight_update")
    llm.collective_rpc("update_weights", kwargs={"update_info": info})
    llm.collective_rpc("finish_weight_update")
    return time.perf_counter() - started


def wrapped_worker(obj: Any) -> Any:
    """The vLLM worker itself, given what `collective_rpc` hands a function: the worker
    (multiprocessing executor) or, in a one-process replica (`UniProcExecutor`, every TP1
    replica), its `WorkerWrapperBase`, which forwards reads to the worker but keeps writes:
    an attribute set on it never reaches the worker's verbs."""
    inner = vars(obj).get("worker")
    return obj if inner is None else inner


def swap_transfer_engine(worker: Any, backend: str) -> str:
    """In a vLLM worker: make `backend`'s weight-transfer engine the worker's (created on
    first use, then kept), and return the backend it replaced. A refit world's replica can
    so also run vLLM's own `nccl` engine: same process, same memory, no second vLLM.
    Set on the worker itself (`wrapped_worker`): set on a TP1 replica's wrapper, the swap
    left the worker's verbs on refitplane's engine, which refused vLLM's `nccl` init_info,
    and the broadcaster waited for a rank that never joined (the in-world baseline's
    "hang" on vLLM 0.26)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    worker = wrapped_worker(worker)
    engines: dict[str, Any] = worker.__dict__.setdefault("_refit_transfer_engines", {})
    active = str(
        worker.__dict__.get(
            "_refit_transfer_backend", worker.vllm_config.weight_transfer_config.backend
        )
    )
    engines[active] = worker.weight_transfer_engine
    if backend not in engines:
        engines[backend] = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend),
            worker.vllm_config,
            worker.device,
            worker.model_runner.get_model(),
        )
    worker.weight_transfer_engine = engines[backend]
    worker._refit_transfer_backend = backend
    return active


def _update_info(shape: str, dtype: str, quant: str) -> dict[str, Any]:
    specs = tensor_specs(shape, dtype, quant)
    return {
        "names": [s.name for s in specs],
        "dtype_names": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
        "packed": True,
    }


def run_vllm_baseline_in_world(
    world: Any, *, repeats: int = 3, probe: Any = None
) -> dict[str, Any]:
    """vLLM's `nccl` engine in a refit world's own replicas: their workers swap to vLLM's
    engine (`swap_transfer_engine`) and a broadcaster beside the trainers on GPU 0 sends
    every tensor whole, as `run_vllm_baseline` does, without a second vLLM start (a minute
    each at the Qwen3-30B-A3B shape); vLLM's own load then lands in the very process and
    memory the refits wrote. GPU 0 holds the trainer's weights and a whole copy (the FP8
    MoE shape: 2 x 31 GiB). The replicas go back to the refitplane engine afterwards.
    Returns what `run_vllm_baseline` does, probe results keyed "baseline-<i>"."""
    from refitplane.testing.child_processes import free_port

    ctx = mp.get_context("spawn")
    replicas = world.replicas()
    master = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "world_size": 1 + sum(world.replica_tps),
    }
    for r in replicas:
        world.ask(r, ("rpc", (swap_transfer_engine, ["nccl"])), "rpc")
    spec = TrainerSpec(world.shape, world.dtype, "", "", 1, "cuda", full=True, quant=world.quant)
    world._spawn(ctx, "broadcaster", broadcaster_main, (spec, master), visible="0")
    offset = 1
    for r, tp in zip(replicas, world.replica_tps, strict=True):
        world._queues[r].put(
            ("call", (baseline_receive, ["init", {**master, "rank_offset": offset}]))
        )
        offset += tp
    _gather(world, {"broadcaster", *replicas}, ("ready", "call"), timeout_s=300)
    info = _update_info(world.shape, world.dtype, world.quant)
    replica_seconds, send_seconds = [], []
    for _ in range(repeats):
        for r in replicas:
            world._queues[r].put(("call", (baseline_receive, ["update", info])))
        world._queues["broadcaster"].put("send")
        got = _gather(world, {"broadcaster", *replicas}, ("call", "sent"), timeout_s=300)
        replica_seconds.append(max(v for k, v in got.items() if k != "broadcaster"))
        send_seconds.append(got["broadcaster"])
    out: dict[str, Any] = {"replica_seconds": replica_seconds, "send_seconds": send_seconds}
    if probe is not None:
        out["probe"] = {
            f"baseline-{i}": world.ask(r, ("rpc", (probe, [])), "rpc")
            for i, r in enumerate(replicas)
        }
    for r in replicas:
        world.ask(r, ("rpc", (swap_transfer_engine, ["refitplane"])), "rpc")
    return out


def _gather(
    world: Any, names: set[str], tags: tuple[str, ...], *, timeout_s: float
) -> dict[str, Any]:
    """Wait until each of `names` answered with one of `tags` (`timeout_s` at most)."""
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while names - got.keys():
        tag, who, payload = world._get(deadline)
        if tag in tags and who in names:
            got[who] = payload
    return got


def broadcaster_main(spec: TrainerSpec, init: dict[str, Any], commands: Any, results: Any) -> None:
    """Trainer rank 0 of the baseline: holds every tensor whole (its gather not counted)
    and broadcasts them, packed, with vLLM's `NCCLWeightTransferEngine.trainer_send_weights`."""
    os.environ.update(SAFE_ENV)
    try:
        import torch
        from vllm.distributed.weight_transfer import nccl_engine

        # vLLM 0.26's trainer-side API (0.32 moved it out of the engine class).
        engine: Any = nccl_engine.NCCLWeightTransferEngine

        torch.cuda.set_device(0)
        tensors = [
            (ts.name, synthetic(ts.name, ts.shape, ts.dtype, "cuda"))
            for ts in tensor_specs(spec.shape, spec.dtype, spec.quant)
        ]
        group = engine.trainer_init(init)
        results.put(("ready", "broadcaster", None))
        while True:
            command = commands.get(timeout=3600)
            if command == "stop":
                break
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine.trainer_send_weights(iter(tensors), {"group": group, "packed": True})
            torch.cuda.synchronize()
            results.put(("sent", "broadcaster", time.perf_counter() - started))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(
            ("error", "broadcaster", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        )


def run_vllm_baseline(
    shape: str,
    replica_tps: tuple[int, ...],
    *,
    first_gpu: int,
    workdir: Path,
    dtype: str = "bfloat16",
    quant: str = "",
    repeats: int = 3,
    gpu_memory_utilization: float = 0.45,
) -> dict[str, Any]:
    """vLLM's built-in `nccl` engine: one broadcaster (GPU 0) → every worker of every
    replica, packed. Returns per-refit seconds measured on the replicas (start → finish).
    `quant`: the checkpoint's quantization (`model_shapes.QUANTS`); vLLM's engine loads it
    through its own layerwise reload."""
    from refitplane.testing.child_processes import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    model_dir = write_config(workdir / f"model-{shape}{quant and '-' + quant}", shape, dtype, quant)
    world_size = 1 + sum(replica_tps)
    master = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": world_size}
    procs, queues = [], {}
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        gpu = first_gpu
        for i, tp in enumerate(replica_tps):
            gpus = ",".join(str(gpu + k) for k in range(tp))
            gpu += tp
            spec = ReplicaSpec(
                str(model_dir),
                f"baseline-{i}",
                tp,
                gpus,
                "",
                "",
                "cuda",
                backend="nccl",
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
            )
            q = ctx.Queue()
            queues[spec.replica_id] = q
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            p = ctx.Process(target=replica_main, args=(spec, q, results))
            p.start()
            procs.append(p)
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        bq = ctx.Queue()
        b = ctx.Process(
            target=broadcaster_main,
            args=(
                TrainerSpec(shape, dtype, "", "", 1, "cuda", full=True, quant=quant),
                master,
                bq,
                results,
            ),
        )
        pending = {f"baseline-{i}" for i in range(len(replica_tps))}
        deadline = time.monotonic() + 1800
        while pending:  # replicas up (vLLM start) before the group forms
            tag, who, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if tag == "error":
                raise RuntimeError(f"{who}: {payload}")
            pending.discard(who)
        b.start()
        procs.append(b)
        offset = 1
        for i, tp in enumerate(replica_tps):
            init = {**master, "rank_offset": offset}
            queues[f"baseline-{i}"].put(("call", (baseline_receive, ["init", init])))
            offset += tp
        waiting = {"broadcaster"} | {f"baseline-{i}" for i in range(len(replica_tps))}
        while waiting:
            tag, who, payload = results.get(timeout=600)
            if tag == "error":
                raise RuntimeError(f"{who}: {payload}")
            waiting.discard(who)
        info = _update_info(shape, dtype, quant)
        replica_seconds, send_seconds = [], []
        for _ in range(repeats):
            for i in range(len(replica_tps)):
                queues[f"baseline-{i}"].put(("call", (baseline_receive, ["update", info])))
            bq.put("send")
            got: dict[str, float] = {}
            while len(got) < len(replica_tps) + 1:
                tag, who, payload = results.get(timeout=900)
                if tag == "error":
                    raise RuntimeError(f"{who}: {payload}")
                got[who] = payload
            replica_seconds.append(max(v for k, v in got.items() if k != "broadcaster"))
            send_seconds.append(got["broadcaster"])
        bq.put("stop")
        return {"replica_seconds": replica_seconds, "send_seconds": send_seconds}
    finally:
        for q in queues.values():
            with contextlib.suppress(Exception):
                q.put(("stop", None))
        for p in procs:
            stop_process(p)
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
