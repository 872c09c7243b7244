from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from refitplane.errors import InvalidArgument
from refitplane.models.tiny import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TINY_VARIANTS,
    WEIGHTS_FILE,
    hf_greedy_tokens,
    load_checkpoint,
    load_hf_model,
    read_tiny_spec,
    tiny_spec,
    write_tiny_model,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_variant_writes_a_checkpoint_transformers_reads(tmp_path: Path, variant: str) -> None:
    root = write_tiny_model(tmp_path / variant, variant, seed=1)
    spec = TINY_VARIANTS[variant]
    assert {p.name for p in root.iterdir()} == {CONFIG_FILE, GENERATION_CONFIG_FILE, WEIGHTS_FILE}
    config = AutoConfig.from_pretrained(root)
    assert config.model_type == spec.kind
    assert config.vocab_size == spec.vocab_size
    assert config.num_key_value_heads == spec.num_kv_heads
    assert config.head_dim == 64
    assert config.tie_word_embeddings == spec.tie_word_embeddings
    tensors = load_checkpoint(root)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == spec.tensor_shapes()
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert read_tiny_spec(root) == spec


def test_tied_model_has_no_lm_head_and_a_padded_vocabulary(tmp_path: Path) -> None:
    root = write_tiny_model(tmp_path, "tied_padded")
    tensors = load_checkpoint(root)
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (333, 128)
    assert TINY_VARIANTS["tied_padded"].padded_vocab_size == 384
    assert 333 % 64 != 0


def test_moe_checkpoint_has_one_tensor_per_expert_and_projection(tmp_path: Path) -> None:
    tensors = load_checkpoint(write_tiny_model(tmp_path, "qwen3_moe", num_experts=8))
    for e in range(8):
        assert tensors[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].shape == (128, 128)
        assert tensors[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].shape == (128, 128)
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (8, 128)
    assert not any("mlp.gate_proj" in n for n in tensors)


def test_weights_are_deterministic_per_seed_and_tensor(tmp_path: Path) -> None:
    a = load_checkpoint(write_tiny_model(tmp_path / "a", "dense", seed=5))
    b = load_checkpoint(write_tiny_model(tmp_path / "b", "dense", seed=5))
    c = load_checkpoint(write_tiny_model(tmp_path / "c", "dense", seed=6))
    # A different vocabulary changes the embedding, not the other tensors.
    d = load_checkpoint(write_tiny_model(tmp_path / "d", "dense", seed=5, vocab_size=400))
    name = "model.layers.1.self_attn.q_proj.weight"
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a[name], c[name])
    assert torch.equal(a[name], d[name])
    # Norms are not all ones: a norm loaded into the wrong place must show.
    norm = a["model.layers.0.input_layernorm.weight"].float()
    assert norm.std() > 0.01
    assert abs(float(norm.mean()) - 1.0) < 0.1


def test_transformers_model_holds_the_checkpoint(tmp_path: Path) -> None:
    root = write_tiny_model(tmp_path, "qwen3_moe", seed=2)
    model = load_hf_model(root)
    state = model.state_dict()
    tensors = load_checkpoint(root)
    assert torch.equal(
        state["model.layers.0.self_attn.k_proj.weight"],
        tensors["model.layers.0.self_attn.k_proj.weight"],
    )
    # transformers 5 fuses per-expert checkpoint tensors into [E, 2I, H] / [E, H, I].
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[2, :128], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(fused[2, 128:], tensors["model.layers.1.mlp.experts.2.up_proj.weight"])


def test_greedy_tokens_equal_full_recompute_argmax(tmp_path: Path) -> None:
    model = load_hf_model(write_tiny_model(tmp_path, "gqa1", seed=4))
    prompt = [3, 1, 4, 1, 5]
    tokens = hf_greedy_tokens(model, prompt, 5)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            logits = model(input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].float().argmax()))
    assert tokens == ids[len(prompt) :]
    assert len(set(tokens)) > 1  # not a degenerate model that repeats one token


def test_float32_variant(tmp_path: Path) -> None:
    tensors = load_checkpoint(write_tiny_model(tmp_path, "dense", dtype="float32"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"


@pytest.mark.parametrize(
    ("kind", "overrides", "field"),
    [
        ("llama", {}, "kind"),
        ("qwen3", {"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ("qwen3", {"hidden_size": 0}, "hidden_size"),
        ("qwen3_moe", {"num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ("qwen3", {"dtype": "int8"}, "dtype"),
    ],
)
def test_invalid_specs_name_the_field(kind: str, overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        tiny_spec(kind, **overrides)
    assert info.value.field == field


def test_greedy_rejects_an_empty_prompt(tmp_path: Path) -> None:
    model = load_hf_model(write_tiny_model(tmp_path, "dense"))
    with pytest.raises(InvalidArgument):
        hf_greedy_tokens(model, [], 3)


def test_read_tiny_spec_rejects_foreign_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(InvalidArgument):
        read_tiny_spec(tmp_path)
