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
