"""Tensor and expert parallelism for Hugging Face causal LMs (Llama / Qwen2 / Qwen3 /
Qwen3-MoE), with torch's DTensor: the demo's trainer, and an example of a DTensor trainer
whose layout `dtensor_shards` publishes without any gathering.

- attention: q/k/v column-parallel, o_proj row-parallel (heads split over the TP ranks);
- dense MLP: gate/up column-parallel, down row-parallel;
- MoE experts: expert parallel. The fused expert weights (`gate_up_proj [E, 2I, H]`,
  `down_proj [E, H, I]`) become `Shard(0)` DTensors, each rank computes its own experts for
  all (replicated) tokens, and the partial outputs are summed with a differentiable
  all-reduce;
- embeddings, norms, router and LM head stay replicated.

Works on CPU with Gloo as on GPUs with NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from refitplane.errors import InvalidArgument


class _SumPartials(torch.autograd.Function):
    """Sum of every rank's partial output. Downstream of it the computation is replicated,
    so each rank's gradient of the sum is already the gradient of its own partial."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToExperts(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ranks, since each rank's experts
    contribute only their share of the gradient of the (replicated) input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ExpertParallelExperts(nn.Module):
    """Drop-in for transformers' fused experts module: this rank's experts only."""

    def __init__(self, experts: Any, mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)
        world = mesh.size()
        if self.num_experts % world:
            raise InvalidArgument(
                f"{self.num_experts} experts do not split evenly over {world} ranks",
                field="num_experts",
            )
        self.mesh = mesh
        self.group = mesh.get_group()
        self.per_rank = self.num_experts // world
        self.first = mesh.get_local_rank() * self.per_rank
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn
        self.gate_up_proj = nn.Parameter(
            distribute_tensor(experts.gate_up_proj.data, mesh, [Shard(0)])
        )
        self.down_proj = nn.Parameter(distribute_tensor(experts.down_proj.data, mesh, [Shard(0)]))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate_up = cast(DTensor, self.gate_up_proj).to_local()
        down = cast(DTensor, self.down_proj).to_local()
        hidden_states = _CopyToExperts.apply(hidden_states, self.group)  # type: ignore[no-untyped-call]
        top_k_weights = _CopyToExperts.apply(top_k_weights, self.group)  # type: ignore[no-untyped-call]
        out = torch.zeros_like(hidden_states)
        for local in range(self.per_rank):
            token_idx, slot = torch.where(top_k_index == self.first + local)
            if token_idx.numel() == 0:
                continue
            gate, up = nn.functional.linear(hidden_states[token_idx], gate_up[local]).chunk(
                2, dim=-1
            )
            y = nn.functional.linear(self.act_fn(gate) * up, down[local])
            y = y * top_k_weights[token_idx, slot, None]
            out = out.index_add(0, token_idx, y.to(out.dtype))
        # Every rank saw every token: summing the per-rank partial outputs completes it.
        summed: torch.Tensor = _SumPartials.apply(out, self.group)  # type: ignore[no-untyped-call]
        return summed


def parallelize_hf_causal_lm(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply TP (and EP for MoE layers) over the 1-D `mesh`, in place; returns the model."""
    if mesh.ndim != 1:
        raise InvalidArgument("parallelize_hf_causal_lm needs a 1-D mesh", field="mesh")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise InvalidArgument("expected a causal LM with model.layers", field="model")
    plan: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts = ExpertParallelExperts(mlp.experts, mesh)
        else:
            plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: all ranks call it). For checks and
    reference generation only; refits never gather."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        data = param.data
        out[name] = data.full_tensor() if isinstance(data, DTensor) else data.detach().clone()
    return out
