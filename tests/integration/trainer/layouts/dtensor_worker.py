"""One rank of a DTensor world: shard a real Hugging Face model with FSDP2 and/or torch
tensor parallelism on CPU, describe the rank's holdings with `dtensor_shards`, check the
boxes against torch's own `compute_local_shape_and_global_offset`, and write them out.

Run by `world.run_world`: argv = out_dir, scenarios JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from reconstruct import save_pieces
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from world import init_from_env

from refitplane.trainer.layouts import dtensor_shards
from refitplane.trainer.layouts.dtensor import dtensor_slices


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"lm_head": ColwiseParallel()}
    for i in range(len(model.model.layers)):  # type: ignore[union-attr,arg-type]
        layer = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}self_attn.{proj}"] = ColwiseParallel()
        plan[f"{layer}self_attn.o_proj"] = RowwiseParallel()
        for proj in ("gate_proj", "up_proj"):
            plan[f"{layer}mlp.{proj}"] = ColwiseParallel()
        plan[f"{layer}mlp.down_proj"] = RowwiseParallel()
    return plan


def fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard(model: torch.nn.Module, kind: str, world: int) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor.parallel import parallelize_module

    if kind == "fsdp2":
        # Wrappers that rename parameters: activation checkpointing, then torch.compile.
        layers = model.model.layers  # type: ignore[union-attr]
        for i, layer in enumerate(layers):  # type: ignore[arg-type]
            layers[i] = checkpoint_wrapper(layer)  # type: ignore[index]
        fsdp(model, init_device_mesh("cpu", (world,)))
        return torch.compile(model)  # type: ignore[return-value]
    if kind == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), tp_plan(model))
        return model
    if kind == "fsdp2_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(model))
        fsdp(model, mesh["dp"])
        return model
    raise ValueError(kind)


def check_against_torch(name: str, param: torch.Tensor) -> None:
    """Our boxes must agree with torch's local shape and first global offset."""
    if not isinstance(param, DTensor):
        return
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    assert tuple(shape) == tuple(param.to_local().shape), (name, shape)
    held = dtensor_slices(name, param)
    if not held:
        assert 0 in tuple(shape), (name, shape)
        return
    first = tuple(lo for lo, _ in held[0].box)
    assert first == tuple(offset), (name, first, offset, param.placements)
    assert sum(h.view.numel() for h in held) == param.to_local().numel(), name


def run_scenario(sc: dict[str, Any], rank: int, world: int, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(sc["hf_dir"], dtype=torch.bfloat16)
    sharded = shard(model, sc["kind"], world)
    params = list(sharded.named_parameters())
    for name, param in params:
        check_against_torch(name, param)
    shards = dtensor_shards(params)
    storages = {
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
        for _, p in params
    }
    for sv in shards:
        assert sv.tensor.untyped_storage().data_ptr() in storages, (
            f"{sv.spec.name} {sv.box} is not a view of a parameter"
        )
    target = out_dir / sc["name"]
    target.mkdir(parents=True, exist_ok=True)
    save_pieces(target / f"rank{rank}.pt", rank, shards)
    names = [n for n, _ in params]
    (target / f"names{rank}.json").write_text(json.dumps(names))


def main() -> None:
    out_dir, scenarios = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = init_from_env()
    for sc in scenarios:
        run_scenario(sc, rank, world, out_dir)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
