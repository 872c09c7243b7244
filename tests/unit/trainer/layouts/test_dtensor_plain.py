"""`dtensor_shards` on an unsharded transformers model: every checkpoint tensor, whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from refitplane.reshard.boxes import full_box
from refitplane.trainer.layouts import dtensor_shards

pytestmark = pytest.mark.unit


def test_plain_qwen3_moe_matches_its_saved_checkpoint(tmp_path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=50,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=24,
        moe_intermediate_size=12,
        num_experts=3,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    )
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    ckpt = load_file(str(tmp_path / "model.safetensors"))

    shards = dtensor_shards(model.named_parameters())

    assert set(shards.names()) == set(ckpt)  # per-expert names; no lm_head (tied)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for sv in shards:
        assert sv.box == full_box(ckpt[sv.spec.name].shape)
        assert torch.equal(sv.tensor, ckpt[sv.spec.name])
        assert sv.tensor.untyped_storage().data_ptr() in storages
    with torch.no_grad():  # the views are live: an in-place update shows through
        model.model.layers[0].mlp.experts.gate_up_proj.add_(1.0)
    view = shards.view("model.layers.0.mlp.experts.2.up_proj.weight", ((0, 12), (0, 16)))
    assert torch.equal(view, ckpt["model.layers.0.mlp.experts.2.up_proj.weight"] + 1.0)


def test_name_map_renames_and_drops() -> None:
    params = [("_orig_mod.wte.weight", torch.zeros(4, 2)), ("_orig_mod.step", torch.zeros(()))]

    def to_hf(name: str) -> str | None:
        return {"wte.weight": "model.embed_tokens.weight"}.get(name)

    shards = dtensor_shards(params, name_map=to_hf)
    assert shards.names() == ["model.embed_tokens.weight"]
    unfused = dtensor_shards(
        [("model.layers.0.mlp.experts.down_proj", torch.zeros(2, 4, 3))], split_fused_experts=False
    )
    assert unfused.names() == ["model.layers.0.mlp.experts.down_proj"]
