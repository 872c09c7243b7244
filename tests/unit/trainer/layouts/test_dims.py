"""ModelDims from real transformers configs, and its validation."""

from __future__ import annotations

import pytest

from refitplane.errors import LayoutError
from refitplane.trainer.layouts.dims import ModelDims

pytestmark = pytest.mark.unit


def test_from_qwen3_and_qwen3_moe_configs() -> None:
    from transformers import Qwen3Config, Qwen3MoeConfig

    dense = ModelDims.from_hf_config(
        Qwen3Config(
            vocab_size=101,
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            tie_word_embeddings=True,
        )
    )
    assert (dense.q_rows, dense.kv_rows, dense.heads_per_group) == (128, 32, 4)
    assert dense.tie_word_embeddings
    assert dense.num_experts == 0
    assert dense.moe_intermediate_size is None
    moe = ModelDims.from_hf_config(
        Qwen3MoeConfig(
            vocab_size=101,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            num_experts=8,
            moe_intermediate_size=32,
        )
    )
    assert (moe.num_experts, moe.moe_intermediate_size) == (8, 32)
    assert moe.expert_ffn(tensor="x") == 32


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cfg.head_dim = None
    assert ModelDims.from_hf_config(cfg).head_dim == 16


def test_invalid_dims_name_the_field() -> None:
    with pytest.raises(LayoutError) as err:
        ModelDims(
            hidden_size=64, num_attention_heads=6, num_key_value_heads=4, head_dim=8, vocab_size=10
        )
    assert err.value.field == "num_key_value_heads"
    with pytest.raises(LayoutError) as err:
        ModelDims(
            hidden_size=0, num_attention_heads=4, num_key_value_heads=4, head_dim=8, vocab_size=10
        )
    assert err.value.field == "hidden_size"


def test_missing_ffn_sizes_are_reported_with_the_tensor() -> None:
    dims = ModelDims(
        hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10
    )
    with pytest.raises(LayoutError, match="intermediate_size") as err:
        dims.dense_ffn(tensor="decoder.layers.0.mlp.linear_fc1.weight")
    assert err.value.tensor == "decoder.layers.0.mlp.linear_fc1.weight"
    with pytest.raises(LayoutError, match="num_experts"):
        dims.expert_ffn(tensor="x")


def test_from_deepseek_v3_config_reads_mla_shared_experts_and_dense_layers() -> None:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=101,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=2,
        first_k_dense_replace=3,
        num_hidden_layers=5,
    )
    dims = ModelDims.from_hf_config(cfg)
    assert dims.is_mla
    assert (dims.q_lora_rank, dims.kv_lora_rank) == (24, 16)
    assert (dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim) == (8, 4, 8)
    assert (dims.num_experts, dims.moe_intermediate_size) == (8, 16)
    # Megatron-Bridge: moe_shared_expert_intermediate_size = moe_intermediate_size * n_shared
    assert dims.shared_expert_intermediate_size == 32
    assert dims.shared_expert_prefix == "mlp.shared_experts."
    assert dims.first_k_dense_replace == 3
    assert dims.rope_interleave
    assert dims.attention_out_features == 4 * 8
    mla = dims.mla
    assert mla is not None
    assert (mla.q_head_dim, mla.kv_a_rows, mla.kv_b_head_rows) == (12, 20, 16)
    assert not ModelDims.from_hf_config(DeepseekV3Config(rope_interleave=False)).rope_interleave


def test_from_deepseek_v2_lite_config_has_no_query_lora() -> None:
    from transformers import DeepseekV2Config

    dims = ModelDims.from_hf_config(
        DeepseekV2Config(q_lora_rank=None, n_routed_experts=64, n_shared_experts=2)
    )
    assert dims.is_mla
    assert dims.q_lora_rank is None
    assert dims.rope_interleave  # DeepSeek-V2 always rotates interleaved pairs
    assert dims.shared_expert_intermediate_size == 2 * (dims.moe_intermediate_size or 0)


def test_from_qwen2_moe_config_names_its_single_shared_expert() -> None:
    from transformers import Qwen2MoeConfig

    dims = ModelDims.from_hf_config(
        Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    )
    assert (dims.shared_expert_intermediate_size, dims.shared_expert_prefix) == (
        24,
        "mlp.shared_expert.",
    )
    assert not dims.is_mla
    assert dims.mla is None
    assert dims.attention_out_features == dims.q_rows


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4}, "v_head_dim"),
        ({"q_lora_rank": 24}, "kv_lora_rank"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"shared_expert_prefix": "mlp.common."}, "shared_expert_prefix"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ],
)
def test_invalid_mla_and_moe_fields_are_named(extra: dict[str, object], field: str) -> None:
    with pytest.raises(LayoutError) as err:
        ModelDims(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=4,
            vocab_size=10,
            **extra,  # type: ignore[arg-type]
        )
    assert err.value.field == field
