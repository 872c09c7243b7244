"""One Megatron-core parameter → the Hugging Face tensor boxes it holds, as views.

Megatron fuses and pads what the checkpoint keeps apart; every rule below undoes one of
those choices by slicing the local parameter, never by copying it:

- `linear_qkv` is GQA-grouped: per query group `[q heads of the group | k | v]`, and
  tensor parallelism gives each rank whole groups. One box per local group and projection.
- `linear_fc1` is `[gate; up]` per tensor-parallel rank (the rank's gate rows, then its
  up rows), for dense MLPs, shared experts and experts alike; with Megatron's GLU
  interleaving it is `[gate 0:k; up 0:k; gate k:2k; up k:2k; ...]` instead, one box per
  block of `k` rows.
- `linear_proj` / `linear_fc2` are row-parallel: the rank holds a column range.
- Embedding and output layer are vocab-parallel over the *padded* vocabulary; the box
  is clipped to the checkpoint's vocabulary and padding rows are not published.
- Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) keeps the checkpoint's projections
  one to one (Megatron-Bridge maps each with a plain AutoMapping, no permutation:
  src/megatron/bridge/models/deepseek/common.py); the up-projections and `q_proj` are
  column-parallel over heads, `linear_proj` row-parallel over heads x v_head_dim, and the
  down-projections either replicated (Transformer Engine spec: `TELinear`,
  `parallel_mode="duplicated"`) or column-parallel (local spec: `ColumnParallelLinear`),
  which the local row count tells apart (megatron/core/transformer/multi_latent_attention.py,
  megatron/core/models/gpt/gpt_layer_specs.py).
- Experts: `local_experts.{i}.linear_fc*` (SequentialMLP), `linear_fc*.weight{i}`
  (TEGroupedMLP), TE's single grouped `linear_fc*.weight` `[n, out, in]` (or its
  `[n*out, in]` logical form), or GroupedMLP's `weight1` `[H, n*2F]` / `weight2`
  `[n*F, H]`, which Megatron itself reads as `view(n, H, 2F)` / `view(n, F, H)`: expert
  `i`'s fc1 is `weight1.view(n, H, -1)[i].T`, a transposed view.
Expert parameters are sliced by the *expert* tensor-parallel rank and numbered by the
expert-parallel rank, which may form a differently shaped mesh over the same ranks.

This module maps each parameter name to its rule and holds the dense ones (QKV, vocab,
norms, MLP); the expert rules are in `megatron_experts`, the multi-latent attention ones
in `megatron_mla`, and the slices they all cut in `megatron_slicing`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import full_box
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.held import HeldSlice
from refitplane.trainer.layouts.megatron_experts import (
    expert_blocks,
    expert_fc,
    grouped_experts,
    shared_fc1,
    shared_fc2,
    shared_gate,
    single_grouped_experts,
)
from refitplane.trainer.layouts.megatron_mla import (
    kv_down,
    kv_norm,
    kv_up,
    not_mla,
    q_down,
    q_norm,
    q_proj,
    q_up,
)
from refitplane.trainer.layouts.megatron_slicing import (
    GluInterleave,
    MegatronParallel,
    MegatronParam,
    col_slice,
    gate_up_slices,
    whole_slice,
)


def _qkv(p: MegatronParam, layer: str, kind: str) -> list[HeldSlice]:
    d, par, t = p.dims, p.par, p.tensor
    not_mla(p)
    per_group, hd = d.heads_per_group, d.head_dim
    group_rows = (per_group + 2) * hd
    if d.num_key_value_heads % par.tp_size:
        raise p.error(
            f"splits {d.num_key_value_heads} query groups over {par.tp_size} tensor-parallel "
            "ranks, which Megatron does not do",
            field="parallel",
        )
    local_groups = d.num_key_value_heads // par.tp_size
    tail = tuple(t.shape[1:])
    p.expect((local_groups * group_rows, *tail))
    if kind == "weight" and tail != (d.hidden_size,):
        raise p.error(f"has {list(tail)} input features, expected {d.hidden_size}")
    tail_box = full_box(tail)
    out: list[HeldSlice] = []
    for j in range(local_groups):
        g = par.tp_rank * local_groups + j
        base = j * group_rows
        k0, v0 = base + per_group * hd, base + (per_group + 1) * hd
        q_rows = (g * per_group * hd, (g + 1) * per_group * hd)
        kv_rows = (g * hd, (g + 1) * hd)
        out += [
            HeldSlice(
                f"{layer}self_attn.q_proj.{kind}",
                (d.q_rows, *tail),
                (q_rows, *tail_box),
                t[base:k0],
            ),
            HeldSlice(
                f"{layer}self_attn.k_proj.{kind}",
                (d.kv_rows, *tail),
                (kv_rows, *tail_box),
                t[k0:v0],
            ),
            HeldSlice(
                f"{layer}self_attn.v_proj.{kind}",
                (d.kv_rows, *tail),
                (kv_rows, *tail_box),
                t[v0 : v0 + hd],
            ),
        ]
    return out


def _vocab(p: MegatronParam, hf_name: str) -> list[HeldSlice]:
    """Vocab-parallel rows of the padded vocabulary, clipped to the checkpoint's."""
    d, par, t = p.dims, p.par, p.tensor
    if t.dim() != 2 or t.shape[1] != d.hidden_size:
        raise p.error(f"has shape {list(t.shape)}, expected [vocab/tp, {d.hidden_size}]")
    local = t.shape[0]
    if local * par.tp_size < d.vocab_size:
        raise p.error(
            f"covers a vocabulary of {local * par.tp_size}, smaller than the checkpoint's "
            f"{d.vocab_size}"
        )
    start = par.tp_rank * local
    stop = min(start + local, d.vocab_size)
    if stop <= start:  # this rank holds padding only
        return []
    shape = (d.vocab_size, d.hidden_size)
    return [HeldSlice(hf_name, shape, ((start, stop), (0, d.hidden_size)), t[: stop - start])]


Rule = Callable[[MegatronParam, str], list[HeldSlice]]


def _hidden_vector(hf_suffix: str) -> Rule:
    return lambda p, layer: whole_slice(p, layer + hf_suffix, (p.dims.hidden_size,))


def _head_vector(hf_suffix: str) -> Rule:
    def rule(p: MegatronParam, layer: str) -> list[HeldSlice]:
        not_mla(p)
        return whole_slice(p, layer + hf_suffix, (p.dims.head_dim,))

    return rule


def _dense_fc1(kind: str) -> Rule:
    def rule(p: MegatronParam, layer: str) -> list[HeldSlice]:
        ffn = p.dims.dense_ffn(tensor=p.name)
        if kind == "weight" and (p.tensor.dim() != 2 or p.tensor.shape[1] != p.dims.hidden_size):
            raise p.error(f"has shape {list(p.tensor.shape)}, expected [2*ffn/tp, hidden]")
        return gate_up_slices(p, p.tensor, f"{layer}mlp.", kind, ffn, p.par.tp_rank, p.par.tp_size)

    return rule


def _row_parallel(hf_suffix: str, full_cols: Callable[[MegatronParam], int]) -> Rule:
    def rule(p: MegatronParam, layer: str) -> list[HeldSlice]:
        if p.tensor.dim() != 2 or p.tensor.shape[0] != p.dims.hidden_size:
            raise p.error(f"has shape {list(p.tensor.shape)}, expected [hidden, in/tp]")
        return [
            col_slice(p, p.tensor, layer + hf_suffix, full_cols(p), p.par.tp_rank, p.par.tp_size)
        ]

    return rule


# Per-layer parameter names (after `decoder.layers.N.`). Norm names cover both the local
# spec (`input_layernorm`, `pre_mlp_layernorm`) and Transformer Engine's fused
# `linear_qkv.layer_norm_*` / `linear_fc1.layer_norm_*`.
_LAYER_RULES: dict[str, Rule] = {
    "input_layernorm.weight": _hidden_vector("input_layernorm.weight"),
    "input_layernorm.bias": _hidden_vector("input_layernorm.bias"),
    "self_attention.linear_qkv.layer_norm_weight": _hidden_vector("input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_bias": _hidden_vector("input_layernorm.bias"),
    "pre_mlp_layernorm.weight": _hidden_vector("post_attention_layernorm.weight"),
    "pre_mlp_layernorm.bias": _hidden_vector("post_attention_layernorm.bias"),
    "mlp.linear_fc1.layer_norm_weight": _hidden_vector("post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_bias": _hidden_vector("post_attention_layernorm.bias"),
    "self_attention.q_layernorm.weight": _head_vector("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _head_vector("self_attn.k_norm.weight"),
    "self_attention.linear_qkv.weight": lambda p, layer: _qkv(p, layer, "weight"),
    "self_attention.linear_qkv.bias": lambda p, layer: _qkv(p, layer, "bias"),
    "self_attention.linear_proj.weight": _row_parallel(
        "self_attn.o_proj.weight", lambda p: p.dims.attention_out_features
    ),
    "self_attention.linear_proj.bias": _hidden_vector("self_attn.o_proj.bias"),
    "mlp.linear_fc1.weight": _dense_fc1("weight"),
    "mlp.linear_fc1.bias": _dense_fc1("bias"),
    "mlp.linear_fc2.weight": _row_parallel(
        "mlp.down_proj.weight", lambda p: p.dims.dense_ffn(tensor=p.name)
    ),
    "mlp.linear_fc2.bias": _hidden_vector("mlp.down_proj.bias"),
    "mlp.router.weight": lambda p, layer: whole_slice(
        p, f"{layer}mlp.gate.weight", (p.dims.num_experts, p.dims.hidden_size)
    ),
    # A buffer, not a parameter (TopKRouter, moe_router_enable_expert_bias), float32;
    # Megatron-Bridge: deepseek_v3_bridge.py maps it to the gate's correction bias.
    "mlp.router.expert_bias": lambda p, layer: whole_slice(
        p, f"{layer}mlp.gate.e_score_correction_bias", (p.dims.num_experts,)
    ),
    "mlp.experts.weight1": lambda p, layer: grouped_experts(p, layer, 1),
    "mlp.experts.weight2": lambda p, layer: grouped_experts(p, layer, 2),
    "mlp.experts.linear_fc1.weight": lambda p, layer: single_grouped_experts(p, layer, 1),
    "mlp.experts.linear_fc2.weight": lambda p, layer: single_grouped_experts(p, layer, 2),
    "mlp.shared_experts.linear_fc1.weight": shared_fc1,
    "mlp.shared_experts.linear_fc2.weight": shared_fc2,
    "mlp.shared_experts.gate_weight": shared_gate,
}

# Multi-latent attention (after `decoder.layers.N.`). `q_layernorm` is also a GQA name
# (per-head q_norm); which one applies is the checkpoint's choice (`ModelDims.is_mla`).
# The `*.layer_norm_weight` names are Transformer Engine's fused norms
# (Megatron-Bridge src/megatron/bridge/models/deepseek/common.py lists both spellings).
_MLA_RULES: dict[str, Rule] = {
    "self_attention.linear_q_proj.weight": q_proj,
    "self_attention.linear_q_proj.layer_norm_weight": _hidden_vector("input_layernorm.weight"),
    "self_attention.linear_q_down_proj.weight": q_down,
    "self_attention.linear_q_up_proj.weight": q_up,
    "self_attention.linear_q_up_proj.layer_norm_weight": q_norm,
    "self_attention.q_layernorm.weight": q_norm,
    "self_attention.linear_kv_down_proj.weight": kv_down,
    "self_attention.linear_kv_up_proj.weight": kv_up,
    "self_attention.linear_kv_up_proj.layer_norm_weight": kv_norm,
    "self_attention.kv_layernorm.weight": kv_norm,
}

# Per-layer names that only a MoE layer has: a checkpoint layer below
# first_k_dense_replace is dense, so one of these there is a moe_layer_freq mismatch.
_MOE_PARTS = ("mlp.router.", "mlp.experts.", "mlp.shared_experts.")

# SequentialMLP and TEGroupedMLP experts (`{i}` is the local expert index).
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.linear_fc(?P<seq_fc>[12])\.weight"
    r"|linear_fc(?P<te_fc>[12])\.weight(?P<te>\d+))$"
)
_LAYER = re.compile(r"^decoder\.layers\.(?P<index>\d+)\.(?P<rest>.+)$")


def _layer_slices(p: MegatronParam, number: int, suffix: str) -> list[HeldSlice]:
    layer = f"model.layers.{number}."
    if suffix.startswith(_MOE_PARTS) and number < p.dims.first_k_dense_replace:
        raise p.error(
            f"is a MoE weight of layer {number}, but the checkpoint's first "
            f"{p.dims.first_k_dense_replace} layers are dense (first_k_dense_replace)",
            field="first_k_dense_replace",
        )
    rule = _MLA_RULES.get(suffix) if p.dims.is_mla else None
    rule = rule or _LAYER_RULES.get(suffix) or _MLA_RULES.get(suffix)
    if rule is not None:
        return rule(p, layer)
    m = _EXPERT.match(suffix)
    if m is not None:
        if m["seq"] is not None:
            fc = int(m["seq_fc"])
            blocks = expert_blocks(p, fc, "SequentialMLP")
            return expert_fc(p, layer, int(m["seq"]), fc, p.tensor, blocks)
        fc = int(m["te_fc"])
        return expert_fc(p, layer, int(m["te"]), fc, p.tensor, expert_blocks(p, fc, None))
    raise p.error("has no Hugging Face counterpart this adapter knows", field="name")


def megatron_param_slices(
    name: str,
    tensor: torch.Tensor,
    *,
    dims: ModelDims,
    parallel: MegatronParallel,
    layer_numbers: Mapping[int, int],
    tied_output: bool,
    glu_interleave: GluInterleave | None = None,
) -> list[HeldSlice]:
    """The Hugging Face boxes one Megatron parameter holds on this rank, as views.

    `layer_numbers` maps the local layer index in `decoder.layers.N` to the global,
    0-based layer index (pipeline and virtual-pipeline offsets included).
    `tied_output`: the output layer shares the word embeddings (Megatron's
    `share_embeddings_and_output_weights`), so a last-stage copy publishes the
    embedding's boxes. `glu_interleave`: the model's GLU interleaving settings, which
    the shapes do not show (default: none).
    """
    p = MegatronParam(name, tensor, dims, parallel, glu_interleave or GluInterleave())
    try:
        return _slices(p, layer_numbers, tied_output)
    except LayoutError as exc:
        if exc.rank is not None:
            raise
        # ModelDims knows the tensor and the field, not which rank asked.
        raise exc.with_rank(parallel.rank) from exc


def _slices(
    p: MegatronParam, layer_numbers: Mapping[int, int], tied_output: bool
) -> list[HeldSlice]:
    name, dims = p.name, p.dims
    if name == "embedding.word_embeddings.weight":
        return _vocab(p, "model.embed_tokens.weight")
    if name == "output_layer.weight":
        return _vocab(p, "model.embed_tokens.weight" if tied_output else "lm_head.weight")
    if name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        return whole_slice(p, "model.norm." + name.rsplit(".", 1)[1], (dims.hidden_size,))
    m = _LAYER.match(name)
    if m is None:
        raise p.error("has no Hugging Face counterpart this adapter knows", field="name")
    index = int(m["index"])
    if index not in layer_numbers:
        raise p.error(f"is in local layer {index}, which the model's decoder does not list")
    return _layer_slices(p, layer_numbers[index], m["rest"])
