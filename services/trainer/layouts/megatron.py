"""Layout source for Megatron-core GPT models (TP / PP / virtual PP / EP / expert TP).

Walks the model's own parameters and maps each to Hugging Face boxes with
`megatron_param_slices`. Three facts come from the model rather than from names:
the global layer index (each `TransformerLayer.layer_number`, which includes the
pipeline offset), whether the output layer is tied to the embedding, and this rank's
tensor / expert / expert-tensor parallel ranks (the model's `pg_collection`, falling back
to `megatron.core.parallel_state`).

Take the shards after the model is wrapped and its optimizer built: Megatron's DDP and
distributed optimizer may move `param.data` into contiguous buffers, and views taken
before that would point at the old storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from refitplane.errors import LayoutError
from refitplane.reshard.shards import LocalShards
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.held import HeldSlice, register
from refitplane.trainer.layouts.megatron_params import MegatronParallel, megatron_param_slices


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rank_and_size(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return int(group.rank()), int(group.size())


def parallel_from_model(model: nn.Module) -> MegatronParallel:
    """This rank's TP / EP / expert-TP coordinates, from the groups the model was built with."""
    pgs = getattr(unwrap(model), "pg_collection", None)
    if pgs is None:
        return parallel_from_parallel_state()
    tp = _rank_and_size(getattr(pgs, "tp", None))
    ep = _rank_and_size(getattr(pgs, "ep", None))
    etp = _rank_and_size(getattr(pgs, "expt_tp", None))
    return MegatronParallel(_global_rank(), *tp, *ep, *etp)


def parallel_from_parallel_state() -> MegatronParallel:
    """This rank's coordinates from Megatron's global `parallel_state` (must be initialised)."""
    from megatron.core import parallel_state as ps

    return MegatronParallel(
        rank=_global_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
    )


def unwrap(model: nn.Module) -> nn.Module:
    """Strip Megatron DDP / Float16Module style wrappers (each keeps the model in `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # type: ignore[assignment]
    return model


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """Virtual pipeline parallelism hands over a list of model chunks; otherwise one model."""
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        return [unwrap(model)]
    return [unwrap(m) for m in model]


def _layer_numbers(core: nn.Module) -> dict[int, int]:
    decoder = getattr(core, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return {}
    out: dict[int, int] = {}
    for index, layer in enumerate(layers):
        number = getattr(layer, "layer_number", None)
        if not isinstance(number, int) or number < 1:
            raise LayoutError(
                f"decoder layer {index} has no 1-based layer_number ({number!r})",
                field="layer_number",
            )
        out[index] = number - 1
    return out


def _check_config(core: nn.Module, dims: ModelDims, par: MegatronParallel) -> None:
    """Fail early, naming the field, when the Megatron model and the checkpoint dims differ."""
    cfg = getattr(core, "config", None)
    if cfg is None:
        return
    heads = getattr(cfg, "num_attention_heads", None)
    pairs = [
        ("hidden_size", getattr(cfg, "hidden_size", None), dims.hidden_size),
        ("num_attention_heads", heads, dims.num_attention_heads),
        (
            "num_key_value_heads",
            getattr(cfg, "num_query_groups", None) or heads,
            dims.num_key_value_heads,
        ),
        ("head_dim", getattr(cfg, "kv_channels", None), dims.head_dim),
        ("num_experts", getattr(cfg, "num_moe_experts", None) or 0, dims.num_experts),
    ]
    for field, megatron_value, hf_value in pairs:
        if megatron_value is not None and megatron_value != hf_value:
            raise LayoutError(
                f"the Megatron model has {field}={megatron_value}, the checkpoint {hf_value}",
                rank=par.rank,
                field=field,
            )
    tied = bool(getattr(core, "share_embeddings_and_output_weights", False))
    if tied != dims.tie_word_embeddings:
        raise LayoutError(
            f"the Megatron model {'shares' if tied else 'does not share'} embedding and output "
            f"weights, the checkpoint has tie_word_embeddings={dims.tie_word_embeddings}",
            rank=par.rank,
            field="tie_word_embeddings",
        )
    # A wrong expert-parallel size would silently renumber experts; the modules know
    # how many experts they hold locally.
    if dims.num_experts:
        expected = dims.num_experts // par.ep_size
        for name, module in core.named_modules():
            local = getattr(module, "num_local_experts", None)
            if isinstance(local, int) and local != expected:
                raise LayoutError(
                    f"{name} holds {local} experts, but {dims.num_experts} experts over "
                    f"{par.ep_size} expert-parallel ranks give {expected}",
                    rank=par.rank,
                    field="ep_size",
                )


def megatron_shards(
    model: nn.Module | Sequence[nn.Module],
    dims: ModelDims | Any,
    parallel: MegatronParallel | None = None,
) -> LocalShards:
    """What this rank holds of every Hugging Face tensor, as views of its live parameters.

    `model`: a Megatron-core `GPTModel` (optionally wrapped in DDP / Float16Module) or the
    list of virtual-pipeline chunks. `dims`: a `ModelDims` or a `transformers` config of
    the checkpoint (its vocabulary size is the unpadded one). `parallel`: this rank's
    coordinates; by default read from the model's process groups.
    """
    chunks = _chunks(model)
    if not chunks:
        raise LayoutError("no model chunks given", field="model")
    hf = dims if isinstance(dims, ModelDims) else ModelDims.from_hf_config(dims)
    par = parallel if parallel is not None else parallel_from_model(chunks[0])
    slices: list[HeldSlice] = []
    for core in chunks:
        _check_config(core, hf, par)
        layer_numbers = _layer_numbers(core)
        tied = bool(getattr(core, "share_embeddings_and_output_weights", False))
        for name, param in core.named_parameters():
            slices += megatron_param_slices(
                name,
                param.detach(),
                dims=hf,
                parallel=par,
                layer_numbers=layer_numbers,
                tied_output=tied,
            )
    return register(slices, rank=par.rank)
