"""Real FSDP2 / tensor-parallel Hugging Face models on Gloo → every tensor rebuilt from views.

Shapes are chosen so shards are uneven (vocabulary 101, MLP width 75, 3 experts), and
the 2x2 mesh (FSDP2 over tensor parallelism) produces `_StridedShard` placements.
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

WORKER = Path(__file__).with_name("dtensor_worker.py")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(1)
    common = {
        "vocab_size": 101,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 75,
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
    }
    dense = Qwen3ForCausalLM(Qwen3Config(**common)).to(torch.bfloat16)
    dense.save_pretrained(root / "dense")
    moe_cfg = Qwen3MoeConfig(
        **common, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=24
    )
    moe = Qwen3MoeForCausalLM(moe_cfg).to(torch.bfloat16)
    moe.save_pretrained(root / "moe")
    return {"dense": str(root / "dense"), "moe": str(root / "moe")}


def _run(tmp_path: Path, world: int, scenarios: list[dict[str, Any]]) -> None:
    run_world(WORKER, world, tmp_path, json.dumps(scenarios), timeout_s=240)
    for sc in scenarios:
        pieces = load_pieces(tmp_path / sc["name"])
        assert {p.rank for p in pieces} == set(range(world))
        check_reconstruction(checkpoint(Path(sc["hf_dir"])), pieces)
        plan_to_single_rank(pieces)


def test_fsdp2_tp2_and_fused_moe_experts_on_two_ranks(
    checkpoints: dict[str, str], tmp_path: Path
) -> None:
    scenarios = [
        {"name": "fsdp2", "kind": "fsdp2", "hf_dir": checkpoints["dense"]},
        {"name": "tp2", "kind": "tp", "hf_dir": checkpoints["dense"]},
        {"name": "fsdp2_moe", "kind": "fsdp2", "hf_dir": checkpoints["moe"]},
    ]
    _run(tmp_path, 2, scenarios)
    # The names really carried the wrapper prefixes the adapter strips.
    names = json.loads((tmp_path / "fsdp2" / "names0.json").read_text())
    assert all(n.startswith("_orig_mod.") for n in names)
    assert any("_checkpoint_wrapped_module." in n for n in names)
    # transformers 5 fuses experts in memory; the published names are per expert.
    moe_names = json.loads((tmp_path / "fsdp2_moe" / "names0.json").read_text())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in moe_names)


def test_fsdp2_over_tp2_on_a_2x2_mesh(checkpoints: dict[str, str], tmp_path: Path) -> None:
    _run(tmp_path, 4, [{"name": "fsdp2_tp2", "kind": "fsdp2_tp", "hf_dir": checkpoints["dense"]}])
    pieces = load_pieces(tmp_path / "fsdp2_tp2")
    # TP rows split 38/37, then FSDP splits each: rank (dp=1, tp=1) holds rows 57..75.
    gate = {p.rank: p.box for p in pieces if p.name == "model.layers.0.mlp.gate_proj.weight"}
    assert gate[3] == ((57, 75), (0, 64))
