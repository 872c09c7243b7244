"""Layout source for DTensor models: FSDP2 `fully_shard`, `parallelize_module`, or both.

A DTensor parameter says everything needed: its mesh (global ranks), placements and
local shard. Each rank describes only what it holds itself; replicas (a `Replicate()`
mesh dimension, or ranks outside an FSDP shard group) simply publish the same boxes and
the planner balances between them. Plain tensors are held whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import full_box, to_slices
from refitplane.reshard.shards import LocalShards
from refitplane.trainer.layouts.fused_experts import unfuse_experts
from refitplane.trainer.layouts.held import HeldSlice, register
from refitplane.trainer.layouts.names import NameMap, canonical_name
from refitplane.trainer.layouts.sharding import MeshSplit, local_pieces, local_shape


def _current_rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def mesh_splits(
    placements: Sequence[Placement],
    shard_order: Sequence[Any] | None = None,
    *,
    tensor: str | None = None,
) -> dict[int, list[MeshSplit]]:
    """Per tensor dimension, the mesh splits applied to it, in the order torch applies them.

    Without an explicit `shard_order`, torch shards left to right over mesh dimensions,
    with `_StridedShard` encoding any other order. A DTensor spec may instead carry an
    explicit `shard_order` (entries of `tensor_dim` and `mesh_dims`), which wins.
    """
    splits: dict[int, list[MeshSplit]] = {}
    strided = False
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            strided = True
            splits.setdefault(p.dim, []).append(MeshSplit(mesh_dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            splits.setdefault(p.dim, []).append(MeshSplit(mesh_dim))
        elif not isinstance(p, Replicate):
            # Partial (pending reduction) and other placements do not describe stored weights.
            raise LayoutError(
                f"placement {p} on mesh dim {mesh_dim} is neither Shard nor Replicate",
                tensor=tensor,
                field="placements",
            )
    if shard_order and not strided:
        ordered: dict[int, list[MeshSplit]] = {}
        for entry in shard_order:
            ordered[int(entry.tensor_dim)] = [MeshSplit(int(m)) for m in entry.mesh_dims]
        if {d: sorted(s.mesh_dim for s in v) for d, v in ordered.items()} != {
            d: sorted(s.mesh_dim for s in v) for d, v in splits.items()
        }:
            raise LayoutError(
                f"shard_order {shard_order} does not match placements {list(placements)}",
                tensor=tensor,
                field="placements",
            )
        return ordered
    return splits


def dtensor_slices(name: str, param: torch.Tensor, *, rank: int | None = None) -> list[HeldSlice]:
    """What this rank holds of `param` (a DTensor or a plain tensor), as views."""
    shape = tuple(int(n) for n in param.shape)
    if not isinstance(param, DTensor):
        return [HeldSlice(name, shape, full_box(shape), param.detach())]
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the parameter's mesh
        return []
    spec = param._spec
    splits = mesh_splits(param.placements, getattr(spec, "shard_order", None), tensor=name)
    pieces = local_pieces(shape, splits, tuple(mesh.shape), coordinate, tensor=name)
    with torch.no_grad():
        local = param.to_local().detach()
    expected = local_shape(pieces, len(shape)) if pieces else None
    if pieces and tuple(local.shape) != expected:
        raise LayoutError(
            f"local shard has shape {list(local.shape)} but placements {list(param.placements)} "
            f"on mesh {list(mesh.shape)} at {list(coordinate)} give {list(expected or ())}",
            tensor=name,
            rank=rank,
            field="shape",
        )
    return [HeldSlice(name, shape, g, local[to_slices(lb)]) for g, lb in pieces]


def dtensor_shards(
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    name_map: NameMap | None = None,
    split_fused_experts: bool = True,
) -> LocalShards:
    """Describe what this rank holds of every parameter, by canonical name, as views.

    `named_params` is typically `model.named_parameters()` after `fully_shard` /
    `parallelize_module`. Wrapper prefixes (`_orig_mod.`, `_fsdp_wrapped_module.`,
    `_checkpoint_wrapped_module.`, a leading `module.`) are stripped, then `name_map`
    renames (a mapping) or renames-or-drops (a callable returning None). With
    `split_fused_experts`, transformers-5 fused `mlp.experts.gate_up_proj/down_proj`
    tensors are published under their per-expert checkpoint names.
    """
    rank = _current_rank()
    slices: list[HeldSlice] = []
    for module_name, param in named_params:
        name = canonical_name(module_name, name_map)
        if name is None:
            continue
        for held in dtensor_slices(name, param, rank=rank):
            slices.extend(unfuse_experts(held) if split_fused_experts else [held])
    return register(slices, rank=rank)
