"""Every refusal of the Megatron layout rules on synthetic shards (DeepSeek-style dimensions,
`megatron_synthetic`): a storage, setting or shape the rules cannot describe is a
`LayoutError` naming the parameter, the rank and the setting at fault."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.megatron_slicing import GluInterleave, MegatronParallel
from tests.unit.trainer.layouts.megatron_synthetic import (
    GQA,
    HEADS,
    KVL,
    LITE,
    MLA,
    NOPE,
    QL,
    R2,
    R2_OF_TP2,
    ROPE,
    SHARED,
    E,
    F,
    H,
    V,
    slices,
    tp,
)

pytestmark = pytest.mark.unit


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape", "par", "dims", "glu", "match", "field"),
    [
        (
            "self_attention.linear_kv_up_proj.weight",
            (HEADS * (NOPE + V), KVL),
            R2,
            GQA,
            None,
            "no kv_lora_rank",
            "kv_lora_rank",
        ),
        (
            "self_attention.linear_qkv.weight",
            (48, H),
            R2,
            MLA,
            None,
            "multi-latent",
            "kv_lora_rank",
        ),
        (
            "self_attention.k_layernorm.weight",
            (ROPE,),
            R2,
            MLA,
            None,
            "multi-latent",
            "kv_lora_rank",
        ),
        (
            "self_attention.linear_q_proj.weight",
            (HEADS * (NOPE + ROPE), H),
            R2,
            MLA,
            None,
            "q_lora_rank=12",
            "q_lora_rank",
        ),
        (
            "self_attention.linear_q_down_proj.weight",
            (QL, H),
            R2,
            LITE,
            None,
            "q_lora_rank=None",
            "q_lora_rank",
        ),
        (
            "self_attention.q_layernorm.weight",
            (QL,),
            R2,
            LITE,
            None,
            "q_lora_rank=None",
            "q_lora_rank",
        ),
        (
            "self_attention.linear_q_up_proj.weight",
            (HEADS * (NOPE + ROPE), QL),
            R2,
            replace(MLA, rope_interleave=False),
            None,
            "rope_interleave=False",
            "rope_interleave",
        ),
        (
            "self_attention.linear_kv_down_proj.weight",
            (KVL + ROPE, H),
            R2,
            replace(MLA, rope_interleave=False),
            None,
            "rope_interleave=False",
            "rope_interleave",
        ),
        (
            "self_attention.linear_kv_up_proj.weight",
            (HEADS * (NOPE + V) // 8, KVL),
            MegatronParallel(rank=2, tp_rank=0, tp_size=8),
            MLA,
            None,
            "4 heads over 8",
            "parallel",
        ),
        (
            "self_attention.linear_kv_down_proj.weight",
            (7, H),
            R2_OF_TP2,
            MLA,
            None,
            "7 rows x 2 ranks",
            "shape",
        ),
        (
            "self_attention.linear_q_up_proj.weight",
            (HEADS * (NOPE + ROPE), QL + 1),
            R2,
            MLA,
            None,
            "expected",
            "shape",
        ),
        (
            "mlp.shared_experts.linear_fc1.weight",
            (2 * SHARED, H),
            R2,
            GQA,
            None,
            "no shared experts",
            "shared_expert_intermediate_size",
        ),
        ("mlp.shared_experts.gate_weight", (1, H), R2, MLA, None, "DeepSeek", "name"),
        (
            "mlp.experts.linear_fc1.weight",
            (3, 2 * F, H),
            R2,
            MLA,
            None,
            r"not \[4, out, in\]",
            "shape",
        ),
        (
            "mlp.experts.linear_fc1.weight",
            (E, 2 * F, H),
            R2,
            MLA,
            GluInterleave(experts=3),
            "moe_mlp_glu_interleave_size=3",
            "moe_mlp_glu_interleave_size",
        ),
        (
            "mlp.experts.local_experts.0.linear_fc1.weight",
            (2 * F, H),
            R2,
            MLA,
            GluInterleave(experts=2),
            "SequentialMLP",
            "moe_mlp_glu_interleave_size",
        ),
        (
            "mlp.experts.weight1",
            (H, E * 2 * F),
            R2,
            MLA,
            GluInterleave(experts=2),
            "legacy GroupedMLP",
            "moe_mlp_glu_interleave_size",
        ),
    ],
)
def test_refusals_name_the_parameter_rank_and_setting(
    name: str,
    shape: tuple[int, ...],
    par: MegatronParallel,
    dims: ModelDims,
    glu: GluInterleave | None,
    match: str,
    field: str,
) -> None:
    full = f"decoder.layers.0.{name}"
    with pytest.raises(LayoutError, match=match) as err:
        slices(full, torch.zeros(shape), par, dims=dims, glu=glu)
    assert (err.value.tensor, err.value.rank, err.value.field) == (full, 2, field)


def test_expert_weights_in_a_checkpoint_dense_layer_are_refused() -> None:
    """first_k_dense_replace=1: layer 0 is dense; a router there is a moe_layer_freq mismatch."""
    for name, shape in (
        ("mlp.router.weight", (E, H)),
        ("mlp.router.expert_bias", (E,)),
        ("mlp.shared_experts.linear_fc2.weight", (H, SHARED)),
        ("mlp.experts.linear_fc2.weight0", (H, F)),
    ):
        with pytest.raises(LayoutError, match="first 1 layers are dense") as err:
            slices(f"decoder.layers.0.{name}", torch.zeros(shape), tp(0, 1), layer=0)
        assert err.value.field == "first_k_dense_replace"
    dense = slices("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(H, 20), tp(0, 1), layer=0)
    assert dense[0].name == "model.layers.0.mlp.down_proj.weight"


def test_glu_interleave_sizes_are_validated() -> None:
    with pytest.raises(LayoutError) as err:
        GluInterleave(shared_experts=0)
    assert err.value.field == "moe_shared_expert_glu_interleave_size"
