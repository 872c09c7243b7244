"""One trainer rank of a refit world: a spawned process, pinned to a GPU (or the CPU), holding
its tensor-parallel share of the synthetic weights (the HF tensor-parallel split), served by
a real `TrainerAgent`. On its command queue: "mem" (peak extra GPU memory since the last
ask), "stop". It puts ("ready", rank, bytes held) once published, ("error", rank, traceback)
if anything fails.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any

from refitplane.testing.model_shapes import tensor_specs
from refitplane.testing.process_world import SAFE_ENV
from refitplane.testing.synthetic_weights import synthetic


@dataclass(frozen=True)
class TrainerSpec:
    shape: str
    dtype: str
    coordinator: str
    job: str
    world_size: int
    device: str  # "cuda" or "cpu"
    full: bool = False  # hold every tensor whole (the baseline broadcaster)
    quant: str = ""


def trainer_main(rank: int, spec: TrainerSpec, commands: Any, results: Any) -> None:
    os.environ.update(SAFE_ENV)
    try:
        import torch

        from refitplane.generator.hf_tensor_parallel import tp_boxes
        from refitplane.reshard.boxes import box_shape, to_slices
        from refitplane.reshard.shards import LocalShards
        from refitplane.trainer.agent import TrainerAgent

        device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shards = LocalShards()
        for ts in tensor_specs(spec.shape, spec.dtype, spec.quant):
            box = tp_boxes(ts, spec.world_size).get(rank)
            if box is None:
                continue
            full = synthetic(ts.name, ts.shape, ts.dtype, device)
            local = torch.empty(box_shape(box), dtype=full.dtype, device=device)
            local.copy_(full[to_slices(box)])
            shards.add(ts, box, local)
            del full
        agent = TrainerAgent(
            coordinator=spec.coordinator,
            job=spec.job,
            rank=rank,
            world_size=spec.world_size,
            shards=shards,
            device=device,
            host="127.0.0.1",
        )
        agent.start()
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results.put(
            ("ready", rank, sum(sv.tensor.numel() * sv.tensor.element_size() for sv in shards))
        )
        while True:
            command = commands.get(timeout=3600)
            if command == "mem":
                peak = (
                    torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
                )
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                results.put(("mem", rank, int(peak)))
            elif command == "stop":
                break
        agent.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
