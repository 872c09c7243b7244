"""Real megatron-core GPTModels over real Gloo worlds → every HF tensor rebuilt from views.

Ground truth is a Hugging Face checkpoint (transformers Qwen3 / Qwen3-MoE / DeepSeek-V3,
random weights, saved with `save_pretrained`, so tensor names are the checkpoint's). Each rank
loads it into its Megatron shard with the worker's own converter, describes its
holdings with `megatron_shards`, and the parent rebuilds every checkpoint tensor from
the boxes and view contents, then plans a refit of all of it to one rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.trainer.layouts.reconstruct import (
    check_reconstruction,
    checkpoint,
    load_pieces,
    plan_to_single_rank,
)
from tests.integration.trainer.layouts.world import run_world

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("megatron_worker.py")
VOCAB, PADDED_VOCAB = 101, 128  # Megatron pads the vocabulary; the checkpoint does not


def _save(model: Any, directory: Path) -> str:
    model.to(torch.bfloat16).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
    }
    out = {}
    for name, tied in (("dense", False), ("dense_tied", True)):
        cfg = Qwen3Config(**common, tie_word_embeddings=tied)
        out[name] = _save(Qwen3ForCausalLM(cfg), root / name)
    moe = Qwen3MoeConfig(
        **common,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],  # one dense layer among MoE layers
        tie_word_embeddings=False,
    )
    out["moe"] = _save(Qwen3MoeForCausalLM(moe), root / "moe")
    for name, q_lora_rank in (("mla", 24), ("mla_lite", None)):
        out[name] = _save_deepseek(root / name, q_lora_rank)
    return out


def _save_deepseek(directory: Path, q_lora_rank: int | None) -> str:
    """A DeepSeek-V3-style checkpoint: MLA (with or without a query LoRA rank, the latter
    as DeepSeek-V2-Lite), one dense layer first, then routed + shared experts and a
    router correction bias stored in float32, the dtype Megatron keeps it in."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    for layer in model.model.layers[cfg.first_k_dense_replace :]:
        # Random, but exactly representable in bf16: the worker's Megatron model is built
        # in bf16 (Float16Module casts buffers too) before the router restores float32.
        layer.mlp.gate.e_score_correction_bias = torch.randn(8).to(torch.bfloat16).float()
    model.save_pretrained(directory)
    return str(directory)


def _scenario(
    name: str,
    hf_dir: str,
    *,
    tp: int,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    vpp: int | None = None,
    grouped: bool = False,
    check_mla: bool = False,
) -> dict[str, Any]:
    return {
        "check_mla": check_mla,
        "name": name,
        "hf_dir": hf_dir,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "etp": etp,
        "vpp": vpp,
        "grouped": grouped,
        "padded_vocab": PADDED_VOCAB,
    }


def _check(out: Path, scenario: dict[str, Any], world: int) -> None:
    pieces = load_pieces(out / scenario["name"])
    assert {p.rank for p in pieces} == set(range(world))
    coverage = check_reconstruction(checkpoint(Path(scenario["hf_dir"])), pieces)
    plan = plan_to_single_rank(pieces)
    assert coverage.tensors > 0
    assert len(plan.links) == world  # every rank sends part of the model


def test_two_ranks_dense_tp2_and_moe_ep2_and_grouped_expert_tp2(
    checkpoints: dict[str, str], tmp_path: Path
) -> None:
    scenarios = [
        _scenario("dense_tp2", checkpoints["dense"], tp=2),
        # Dense TP2 and experts on EP2 x expert-TP1 over the same two ranks.
        _scenario("moe_tp2_ep2", checkpoints["moe"], tp=2, ep=2),
        # GroupedMLP (one [H, n*2F] / [n*F, H] tensor per rank), experts split by expert-TP2.
        _scenario("moe_grouped_etp2", checkpoints["moe"], tp=2, etp=2, grouped=True),
    ]
    run_world(WORKER, 2, tmp_path, json.dumps(scenarios))
    for sc in scenarios:
        _check(tmp_path, sc, 2)


def test_four_ranks_pipeline_tied_embeddings_and_expert_mesh_over_dense_replicas(
    checkpoints: dict[str, str], tmp_path: Path
) -> None:
    scenarios = [
        # The last stage's output layer is a copy of the first stage's embedding.
        _scenario("dense_tied_tp2_pp2", checkpoints["dense_tied"], tp=2, pp=2),
        _scenario("moe_grouped_tp2_pp2_ep2", checkpoints["moe"], tp=2, pp=2, ep=2, grouped=True),
        # Dense TP2 x DP2 (replicas) while experts spread over EP4 across all four ranks.
        _scenario("moe_tp2_dp2_ep4", checkpoints["moe"], tp=2, ep=4),
        # Virtual pipeline: each rank holds two model chunks (layers 0 and 2, or 1 and 3).
        _scenario("dense_tp2_pp2_vpp2", checkpoints["dense"], tp=2, pp=2, vpp=2),
    ]
    run_world(WORKER, 4, tmp_path, json.dumps(scenarios), timeout_s=240)
    for sc in scenarios:
        _check(tmp_path, sc, 4)
    tied = load_pieces(tmp_path / "dense_tied_tp2_pp2")
    embed_holders = {p.rank for p in tied if p.name == "model.embed_tokens.weight"}
    assert embed_holders == {0, 1, 2, 3}  # first stage (embedding) and last (output layer)
    replicas = check_reconstruction(
        checkpoint(Path(checkpoints["moe"])), load_pieces(tmp_path / "moe_tp2_dp2_ep4")
    )
    assert replicas.replicated_elements > 0  # the dense weights of both data-parallel replicas
    vpp = load_pieces(tmp_path / "dense_tp2_pp2_vpp2")
    stage0 = {p.name.split(".")[2] for p in vpp if p.rank == 0 and ".layers." in p.name}
    assert stage0 == {"0", "2"}


def test_two_ranks_deepseek_mla_shared_experts_and_expert_bias_tp1_tp2_ep2(
    checkpoints: dict[str, str], tmp_path: Path
) -> None:
    scenarios = [
        # TP1 (the two ranks are data-parallel replicas); each rank also checks that
        # Megatron's MLA query/key/value from the converted weights equal transformers'.
        _scenario("mla_tp1", checkpoints["mla"], tp=1, check_mla=True),
        _scenario("mla_lite_tp1", checkpoints["mla_lite"], tp=1, check_mla=True),
        # TP2: heads split; the local spec's down-projections are column-parallel too.
        _scenario("mla_tp2", checkpoints["mla"], tp=2),
        # TP2 with the routed experts over EP2 (shared experts stay on dense TP).
        _scenario("mla_tp2_ep2", checkpoints["mla"], tp=2, ep=2),
        # No query LoRA (one q_proj), legacy GroupedMLP experts split by expert-TP2.
        _scenario("mla_lite_tp2_grouped_etp2", checkpoints["mla_lite"], tp=2, etp=2, grouped=True),
    ]
    run_world(WORKER, 2, tmp_path, json.dumps(scenarios), timeout_s=240)
    for sc in scenarios:
        _check(tmp_path, sc, 2)
    pieces = load_pieces(tmp_path / "mla_tp2_ep2")
    bias = [p for p in pieces if p.name.endswith("mlp.gate.e_score_correction_bias")]
    assert bias
    assert all(p.data.dtype == torch.float32 for p in bias)
    kv_a = {
        p.rank: p.box
        for p in pieces
        if p.name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    }
    assert kv_a == {0: ((0, 10), (0, 64)), 1: ((10, 20), (0, 64))}  # column-parallel here
