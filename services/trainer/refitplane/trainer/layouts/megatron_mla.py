"""Megatron's multi-latent attention parameters (DeepSeek-V2/V3, Kimi-K2) → the Hugging
Face boxes they hold.

Megatron keeps the checkpoint's projections one to one (Megatron-Bridge maps each with a
plain AutoMapping, no permutation: src/megatron/bridge/models/deepseek/common.py); the
up-projections and `q_proj` are column-parallel over heads, and the down-projections
either replicated (Transformer Engine spec: `TELinear`, `parallel_mode="duplicated"`) or
column-parallel (local spec: `ColumnParallelLinear`), which the local row count tells
apart (megatron/core/transformer/multi_latent_attention.py,
megatron/core/models/gpt/gpt_layer_specs.py).
"""

from __future__ import annotations

import torch

from refitplane.reshard.boxes import full_box
from refitplane.trainer.layouts.dims import MlaDims
from refitplane.trainer.layouts.held import HeldSlice
from refitplane.trainer.layouts.megatron_slicing import MegatronParam, row_slice, whole_slice


def not_mla(p: MegatronParam) -> None:
    if p.dims.is_mla:
        raise p.error(
            f"belongs to grouped-query attention, but the checkpoint is multi-latent "
            f"attention (kv_lora_rank={p.dims.kv_lora_rank})",
            field="kv_lora_rank",
        )


def _mla(p: MegatronParam) -> MlaDims:
    m = p.dims.mla
    if m is None:
        raise p.error(
            "is a multi-latent attention weight, but the checkpoint has no kv_lora_rank",
            field="kv_lora_rank",
        )
    return m


def _q_lora_rank(p: MegatronParam, m: MlaDims) -> int:
    """`linear_q_down/up_proj` and `q_layernorm` exist only with a query LoRA rank."""
    if m.q_lora_rank is None:
        raise p.error(
            "is a low-rank query weight, but the checkpoint has q_lora_rank=None "
            "(its queries are one q_proj)",
            field="q_lora_rank",
        )
    return m.q_lora_rank


def _rotary_rows(p: MegatronParam) -> None:
    """Rows that include rotary dims are published as they are: both Megatron
    (`_apply_rotary_pos_emb_bshd` with multi_latent_attention: `t[..., 0::2]`,
    `t[..., 1::2]`) and the checkpoint (DeepSeek's interleaved pairs, transformers'
    `rope_interleave=True`) rotate interleaved pairs. A checkpoint keeping them in halves
    would need those rows permuted."""
    if not p.dims.rope_interleave:
        raise p.error(
            "holds rotary rows, which Megatron's MLA rotates as interleaved pairs, but the "
            "checkpoint has rope_interleave=False (halves); not mapped",
            field="rope_interleave",
        )


def _mla_2d(p: MegatronParam, in_features: int) -> torch.Tensor:
    t = p.tensor
    if t.dim() != 2 or t.shape[1] != in_features:
        raise p.error(f"has shape {list(t.shape)}, expected [rows, {in_features}]")
    return t


def _mla_heads(p: MegatronParam, hf_name: str, per_head: int, in_features: int) -> list[HeldSlice]:
    """Column-parallel over heads: rank `r` holds heads `[r*n/tp, (r+1)*n/tp)`, each head's
    rows contiguous, so its local rows are one row range of the checkpoint tensor."""
    m, par = _mla(p), p.par
    if m.heads % par.tp_size:
        raise p.error(
            f"splits {m.heads} heads over {par.tp_size} tensor-parallel ranks, which Megatron "
            "does not do",
            field="parallel",
        )
    t = _mla_2d(p, in_features)
    return [row_slice(p, t, hf_name, m.heads * per_head, par.tp_rank, par.tp_size)]


def _mla_down(p: MegatronParam, hf_name: str, full_rows: int) -> list[HeldSlice]:
    """`linear_q_down_proj` / `linear_kv_down_proj`: whole when replicated (TE spec's
    duplicated TELinear), a row range when column-parallel (local spec)."""
    t = _mla_2d(p, p.dims.hidden_size)
    if t.shape[0] == full_rows:
        shape = (full_rows, p.dims.hidden_size)
        return [HeldSlice(hf_name, shape, full_box(shape), t)]
    return [row_slice(p, t, hf_name, full_rows, p.par.tp_rank, p.par.tp_size)]


def q_proj(p: MegatronParam, layer: str) -> list[HeldSlice]:
    """`linear_q_proj` (q_lora_rank None, DeepSeek-V2-Lite): per head `[nope; rope]`."""
    m = _mla(p)
    if m.q_lora_rank is not None:
        raise p.error(
            f"is a single query projection, but the checkpoint has q_lora_rank="
            f"{m.q_lora_rank} (q_a_proj / q_b_proj)",
            field="q_lora_rank",
        )
    _rotary_rows(p)
    return _mla_heads(p, f"{layer}self_attn.q_proj.weight", m.q_head_dim, p.dims.hidden_size)


def q_down(p: MegatronParam, layer: str) -> list[HeldSlice]:
    m = _mla(p)
    return _mla_down(p, f"{layer}self_attn.q_a_proj.weight", _q_lora_rank(p, m))


def q_up(p: MegatronParam, layer: str) -> list[HeldSlice]:
    m = _mla(p)
    rank = _q_lora_rank(p, m)
    _rotary_rows(p)
    return _mla_heads(p, f"{layer}self_attn.q_b_proj.weight", m.q_head_dim, rank)


def q_norm(p: MegatronParam, layer: str) -> list[HeldSlice]:
    return whole_slice(p, f"{layer}self_attn.q_a_layernorm.weight", (_q_lora_rank(p, _mla(p)),))


def kv_down(p: MegatronParam, layer: str) -> list[HeldSlice]:
    """`kv_a_proj_with_mqa` rows are `[compressed kv (kv_lora_rank); rotary key
    (qk_rope_head_dim)]` in both: Megatron splits its output `[kv_lora_rank,
    qk_pos_emb_head_dim]` in that order, as transformers' DeepSeek-V3 does."""
    m = _mla(p)
    _rotary_rows(p)
    return _mla_down(p, f"{layer}self_attn.kv_a_proj_with_mqa.weight", m.kv_a_rows)


def kv_up(p: MegatronParam, layer: str) -> list[HeldSlice]:
    """Per head `[no-position key; value]` in both (Megatron views its output as
    `[n, qk_head_dim + v_head_dim]` and splits it in that order)."""
    m = _mla(p)
    name = f"{layer}self_attn.kv_b_proj.weight"
    return _mla_heads(p, name, m.kv_b_head_rows, m.kv_lora_rank)


def kv_norm(p: MegatronParam, layer: str) -> list[HeldSlice]:
    return whole_slice(p, f"{layer}self_attn.kv_a_layernorm.weight", (_mla(p).kv_lora_rank,))
