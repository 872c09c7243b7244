"""What `megatron_shards` reads from the model besides parameter names: the router's
expert-bias buffer (kept in float32 the way Megatron's router keeps it), the GLU
interleaving settings of the config, and the MLA fields it checks against the checkpoint.
Small stand-in modules carry exactly the attributes Megatron's modules have."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from refitplane.errors import LayoutError
from refitplane.trainer.layouts import MegatronParallel, ModelDims, megatron_shards
from refitplane.trainer.layouts.megatron import glu_interleave_from_config
from refitplane.trainer.layouts.megatron_slicing import GluInterleave

pytestmark = pytest.mark.unit

H, E = 8, 4
DIMS = ModelDims(
    hidden_size=H,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=2,
    vocab_size=10,
    moe_intermediate_size=4,
    num_experts=E,
    q_lora_rank=4,
    kv_lora_rank=4,
    qk_nope_head_dim=2,
    qk_rope_head_dim=2,
    v_head_dim=2,
)


class Router(nn.Module):
    """TopKRouter's weight, its float32 expert_bias buffer (which Float16Module casts to
    bf16) and `_maintain_float32_expert_bias`, as in megatron/core/transformer/moe/router.py."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H, dtype=torch.bfloat16))
        self.register_buffer("expert_bias", torch.randn(E).to(torch.bfloat16))
        self.register_buffer("local_tokens_per_expert", torch.zeros(E), persistent=False)

    def _maintain_float32_expert_bias(self) -> None:
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)


class Layer(nn.Module):
    def __init__(self, number: int, mlp: nn.Module) -> None:
        super().__init__()
        self.layer_number = number
        self.mlp = mlp


class Model(nn.Module):
    def __init__(self, mlp: nn.Module, **config: Any) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            hidden_size=H,
            num_attention_heads=2,
            num_query_groups=None,
            num_moe_experts=E,
            multi_latent_attention=True,
            q_lora_rank=4,
            kv_lora_rank=4,
            qk_head_dim=2,
            qk_pos_emb_head_dim=2,
            v_head_dim=2,
            kv_channels=4,  # hidden / heads: meaningless for MLA, so not compared
            **config,
        )
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([Layer(2, mlp)])


def moe_mlp() -> nn.Module:
    mlp = nn.Module()
    mlp.router = Router()
    return mlp


def test_expert_bias_is_published_as_a_view_of_its_float32_storage() -> None:
    mlp = moe_mlp()
    model = Model(mlp)
    router: Any = mlp.router
    before = router.expert_bias.clone()
    shards = megatron_shards(model, DIMS, MegatronParallel(rank=0))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    (view,) = [sv.tensor for sv in shards if sv.spec.name == name]
    # The router would move it to a new float32 storage at its next forward; it has moved
    # already, and the published view is of the storage that stays.
    assert router.expert_bias.dtype == torch.float32
    assert view.dtype == torch.float32
    assert view.untyped_storage().data_ptr() == router.expert_bias.untyped_storage().data_ptr()
    assert torch.equal(view, before.float())
    assert {sv.spec.name for sv in shards} == {name, "model.layers.1.mlp.gate.weight"}


def test_glu_interleaving_comes_from_the_config() -> None:
    model = Model(moe_mlp(), moe_mlp_glu_interleave_size=32)
    par = MegatronParallel(rank=0)
    assert glu_interleave_from_config(model, par) == GluInterleave(experts=32)
    model.config.moe_shared_expert_glu_interleave_size = 16
    assert glu_interleave_from_config(model, par) == GluInterleave(experts=32, shared_experts=16)
    model.config.moe_mlp_glu_interleave_size = 0
    with pytest.raises(LayoutError) as err:
        glu_interleave_from_config(model, MegatronParallel(rank=3))
    assert (err.value.rank, err.value.field) == (3, "moe_mlp_glu_interleave_size")


def test_dense_mlps_bridge_may_have_interleaved_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dense = nn.Module()
    dense.linear_fc1 = nn.Linear(H, 2 * H, bias=False)
    model = Model(dense, moe_mlp_glu_interleave_size=32)
    par = MegatronParallel(rank=1)
    assert glu_interleave_from_config(model, par).experts == 32  # unset: [gate; up]
    monkeypatch.setenv("USE_ACT_FUSION_FOR_DENSE", "1")
    with pytest.raises(LayoutError, match=r"decoder\.layers\.0\.mlp") as err:
        glu_interleave_from_config(model, par)
    assert (err.value.rank, err.value.field) == (1, "USE_ACT_FUSION_FOR_DENSE")

    class TEFusedMLPWithGroupedLinear(nn.Module):
        pass

    monkeypatch.delenv("USE_ACT_FUSION_FOR_DENSE")
    with pytest.raises(LayoutError, match="TEFusedMLPWithGroupedLinear"):
        glu_interleave_from_config(Model(TEFusedMLPWithGroupedLinear()), par)


@pytest.mark.parametrize(
    ("dims", "config", "field"),
    [
        (replace(DIMS, q_lora_rank=None), {}, "q_lora_rank"),
        (DIMS, {"q_lora_rank": None}, "q_lora_rank"),
        (replace(DIMS, kv_lora_rank=8), {}, "kv_lora_rank"),
        (replace(DIMS, qk_nope_head_dim=4), {}, "qk_nope_head_dim"),
        (replace(DIMS, qk_rope_head_dim=4), {}, "qk_rope_head_dim"),
        (replace(DIMS, v_head_dim=4), {}, "v_head_dim"),
        (DIMS, {"moe_shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
        (
            replace(
                DIMS,
                q_lora_rank=None,
                kv_lora_rank=None,
                qk_nope_head_dim=None,
                qk_rope_head_dim=None,
                v_head_dim=None,
            ),
            {},
            "kv_lora_rank",
        ),
    ],
)
def test_mla_fields_that_disagree_with_the_model_are_refused(
    dims: ModelDims, config: dict[str, Any], field: str
) -> None:
    model = Model(moe_mlp())
    for key, value in config.items():
        setattr(model.config, key, value)
    with pytest.raises(LayoutError) as err:
        megatron_shards(model, dims, MegatronParallel(rank=2))
    assert (err.value.field, err.value.rank) == (field, 2)
