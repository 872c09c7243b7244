"""Dense zoo architectures: one MLP per layer, grouped-query attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from refitplane.models.zoo.arch import (
    DERIVED_HEAD_DIM,
    EXPLICIT_HEAD_DIM,
    ZooArch,
    tiny_config,
)

DENSE_ARCHS: Final[Mapping[str, ZooArch]] = {
    "llama": ZooArch(
        "llama",
        tiny_config(EXPLICIT_HEAD_DIM),
        hub_names=("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"),
        notes="Plain dense GQA model; the reference layout.",
    ),
    "qwen2": ZooArch(
        "qwen2",
        tiny_config(DERIVED_HEAD_DIM),
        hub_names=("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"),
        notes="q/k/v projections carry biases (always on in Qwen2); no o_proj bias.",
    ),
    "qwen3": ZooArch(
        "qwen3",
        tiny_config(EXPLICIT_HEAD_DIM),
        hub_names=(
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
        ),
        notes="Per-head q/k RMSNorm (head_dim wide).",
    ),
    "phi3": ZooArch(
        "phi3",
        tiny_config(DERIVED_HEAD_DIM, original_max_position_embeddings=512),
        hub_names=(
            "model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight",
        ),
        notes="The checkpoint itself holds fused qkv_proj [q|k|v] and gate_up_proj [gate|up].",
    ),
    "gemma2": ZooArch(
        "gemma2",
        tiny_config(
            EXPLICIT_HEAD_DIM,
            tie_word_embeddings=True,
            query_pre_attn_scalar=64,
            sliding_window=128,
        ),
        hub_names=(
            "model.layers.0.pre_feedforward_layernorm.weight",
            "model.layers.0.post_feedforward_layernorm.weight",
        ),
        notes=(
            "Tied embeddings (no lm_head.weight), RMSNorm scaling by 1 + w, sandwich norms, "
            "logit soft-capping, alternating sliding-window (128) / full attention layers."
        ),
        norm_adds_one=True,
    ),
}
