"""Layout source for Megatron-core GPT models (TP / PP / virtual PP / EP / expert TP).

Walks the model's own parameters (and the one buffer that is a checkpoint weight, the
router's `expert_bias`) and maps each to Hugging Face boxes with `megatron_param_slices`.
Four facts come from the model rather than from names: the global layer index (each
`TransformerLayer.layer_number`, which includes the pipeline offset), whether the output
layer is tied to the embedding, the GLU interleaving settings of its config, and this
rank's tensor / expert / expert-tensor parallel ranks (the model's `pg_collection`,
falling back to `megatron.core.parallel_state`).

Take the shards after the model is wrapped and its optimizer built: Megatron's DDP and
distributed optimizer may move `param.data` into contiguous buffers, and views taken
before that would point at the old storage.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from refitplane.errors import LayoutError
from refitplane.reshard.shards import LocalShards
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.held import HeldSlice, register
from refitplane.trainer.layouts.megatron_params import megatron_param_slices
from refitplane.trainer.layouts.megatron_slicing import GluInterleave, MegatronParallel

# Buffers that are checkpoint weights; every other buffer (rotary tables, token counters)
# is derived state the generator rebuilds itself.
_WEIGHT_BUFFERS = (".mlp.router.expert_bias",)


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
    mla = bool(getattr(cfg, "multi_latent_attention", False))
    if mla != dims.is_mla:
        raise LayoutError(
            f"the Megatron model has multi_latent_attention={mla}, the checkpoint "
            f"kv_lora_rank={dims.kv_lora_rank}",
            rank=par.rank,
            field="kv_lora_rank",
        )
    pairs: list[tuple[str, object, object]] = [
        ("hidden_size", getattr(cfg, "hidden_size", None), dims.hidden_size),
        ("num_attention_heads", heads, dims.num_attention_heads),
        (
            "num_key_value_heads",
            getattr(cfg, "num_query_groups", None) or heads,
            dims.num_key_value_heads,
        ),
        ("num_experts", getattr(cfg, "num_moe_experts", None) or 0, dims.num_experts),
    ]
    if mla:
        # MLATransformerConfig names (megatron/core/transformer/transformer_config.py);
        # kv_channels means nothing to MLA and the checkpoint's head_dim is the rope part.
        q_lora = getattr(cfg, "q_lora_rank", None)
        if q_lora != dims.q_lora_rank:  # None is meaningful here: one q_proj, no q_a/q_b
            raise LayoutError(
                f"the Megatron model has q_lora_rank={q_lora}, the checkpoint {dims.q_lora_rank}",
                rank=par.rank,
                field="q_lora_rank",
            )
        pairs += [
            ("kv_lora_rank", getattr(cfg, "kv_lora_rank", None), dims.kv_lora_rank),
            ("qk_nope_head_dim", getattr(cfg, "qk_head_dim", None), dims.qk_nope_head_dim),
            ("qk_rope_head_dim", getattr(cfg, "qk_pos_emb_head_dim", None), dims.qk_rope_head_dim),
            ("v_head_dim", getattr(cfg, "v_head_dim", None), dims.v_head_dim),
        ]
    else:
        pairs.append(("head_dim", getattr(cfg, "kv_channels", None), dims.head_dim))
    shared = getattr(cfg, "moe_shared_expert_intermediate_size", None)
    if shared is not None:
        pairs.append(
            ("shared_expert_intermediate_size", shared, dims.shared_expert_intermediate_size)
        )
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


def glu_interleave_from_config(core: nn.Module, par: MegatronParallel) -> GluInterleave:
    """The model's GLU interleaving (Megatron-LM config fields; absent in older releases).

    Megatron-Bridge also interleaves *dense* fc1 weights when its training runs with
    `USE_ACT_FUSION_FOR_DENSE=1` (for Transformer Engine's `TEFusedMLPWithGroupedLinear`;
    src/megatron/bridge/training/checkpointing.py, `_is_swiglu_fc1_checkpoint_key`). That
    choice lives in the process environment and the loader, not in the model, so such a
    dense MLP is refused rather than guessed.
    """
    cfg = getattr(core, "config", None)
    experts = getattr(cfg, "moe_mlp_glu_interleave_size", None)
    shared = getattr(cfg, "moe_shared_expert_glu_interleave_size", None)
    fused_dense = os.environ.get("USE_ACT_FUSION_FOR_DENSE", "0") == "1" and experts is not None
    for name, module in core.named_modules():
        dense_mlp = name.endswith(".mlp") and not hasattr(module, "router")
        if fused_dense and dense_mlp and hasattr(module, "linear_fc1"):
            raise LayoutError(
                f"{name}: with USE_ACT_FUSION_FOR_DENSE=1 Megatron-Bridge interleaves "
                "dense fc1 weights in memory; not mapped",
                rank=par.rank,
                field="USE_ACT_FUSION_FOR_DENSE",
            )
        if type(module).__name__ == "TEFusedMLPWithGroupedLinear":
            raise LayoutError(
                f"{name} is a TEFusedMLPWithGroupedLinear, whose fc1 layout (interleaved or "
                "not) depends on how its weights were loaded; not mapped",
                rank=par.rank,
                field="USE_ACT_FUSION_FOR_DENSE",
            )
    try:
        return GluInterleave(experts=experts, shared_experts=shared)
    except LayoutError as exc:
        raise exc.with_rank(par.rank) from exc


def _weight_buffers(core: nn.Module) -> list[tuple[str, Any]]:
    """The router's `expert_bias` buffers, in float32 as Megatron keeps them.

    Float16Module casts every buffer to bf16; the router moves `expert_bias` back to a
    *new* float32 storage at its next forward, state-dict save or load
    (`TopKRouter._maintain_float32_expert_bias`). A view taken before that would point at
    the abandoned storage, so the same (idempotent) call is made here first.
    """
    for module in core.modules():
        maintain = getattr(module, "_maintain_float32_expert_bias", None)
        if callable(maintain):
            maintain()
    return [(n, b) for n, b in core.named_buffers() if n.endswith(_WEIGHT_BUFFERS)]


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
        glu = glu_interleave_from_config(core, par)
        layer_numbers = _layer_numbers(core)
        tied = bool(getattr(core, "share_embeddings_and_output_weights", False))
        for name, param in [*core.named_parameters(), *_weight_buffers(core)]:
            slices += megatron_param_slices(
                name,
                param.detach(),
                dims=hf,
                parallel=par,
                layer_numbers=layer_numbers,
                tied_output=tied,
                glu_interleave=glu,
            )
    return register(slices, rank=par.rank)
