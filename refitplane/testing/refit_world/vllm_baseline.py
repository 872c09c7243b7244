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
    if phase == "init":
        llm.init_weight_transfer_engine({"init_info": info})
        return None
    started = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": info})
    llm.finish_weight_update()
    return time.perf_counter() - started


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
    repeats: int = 3,
    gpu_memory_utilization: float = 0.45,
) -> dict[str, Any]:
    """vLLM's built-in `nccl` engine: one broadcaster (GPU 0) → every worker of every
    replica, packed. Returns per-refit seconds measured on the replicas (start → finish)."""
    from refitplane.demo.processes import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    model_dir = write_config(workdir / f"model-{shape}", shape, dtype)
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
            args=(TrainerSpec(shape, dtype, "", "", 1, "cuda", full=True), master, bq, results),
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
        specs = tensor_specs(shape, dtype)
        info = {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "packed": True,
        }
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
