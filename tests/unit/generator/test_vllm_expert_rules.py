"""The routed-experts rule (`vllm_expert_rules.routed_experts`) for block-FP8 experts: the
placements of `w13_weight` / `w2_weight` and of their `weight_scale_inv` block scales, in
block units, at TP 2 with an expert map, and the layouts it refuses. The layer here carries
the attributes vLLM's `RoutedExperts` / `Fp8MoEMethod` expose (vLLM 0.26 and 0.32); that
vLLM's own loader writes what the rule says is proved at engine start by the rule check
(tests/integration/generator/test_fp8_experts_cpu.py, and on GPUs by the lead's runs)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.generator.vllm_expert_rules import routed_experts
from refitplane.generator.vllm_layout import VllmRanks
from refitplane.generator.vllm_rule_parts import LayerContext

pytestmark = pytest.mark.unit

PATH = "model.layers.0.mlp.experts"
SCALE = "float32"


class Fp8MoEMethod:
    """vLLM's block-FP8 MoE method as the rule reads it (its class name and attributes)."""

    def __init__(self, block: list[int] | None, activation_scheme: str = "dynamic") -> None:
        self.weight_block_size = block
        self.quant_config = SimpleNamespace(activation_scheme=activation_scheme)


def _layer(
    *,
    hidden: int = 256,
    inter: int = 512,
    tp: tuple[int, int] = (1, 2),
    expert_map: list[int] | None = None,
    block: list[int] | None = None,
    activation_scheme: str = "dynamic",
) -> Any:
    tp_rank, tp_size = tp
    n_global = 4 if expert_map is None else len(expert_map)
    n_local = n_global if expert_map is None else sum(1 for v in expert_map if v >= 0)
    parallel = SimpleNamespace(enable_eplb=False, tp_rank=tp_rank, tp_size=tp_size)
    config = SimpleNamespace(
        moe_parallel_config=parallel,
        num_experts=n_global,
        num_logical_experts=n_global,
        is_act_and_mul=True,
        hidden_dim_unpadded=hidden,
        hidden_dim=hidden,
        intermediate_size=inter,
    )
    return SimpleNamespace(
        quant_method=Fp8MoEMethod([128, 128] if block is None else block, activation_scheme),
        moe_config=config,
        hidden_size=hidden,
        intermediate_size_per_partition=inter // tp_size,
        local_num_experts=n_local,
        _expert_map=None if expert_map is None else torch.tensor(expert_map),
        layer_name=PATH,
        ckpt_gate_proj_name="gate_proj",
        ckpt_up_proj_name="up_proj",
        ckpt_down_proj_name="down_proj",
    )


def _owned(layer: Any, extra: tuple[str, ...] = ()) -> dict[str, torch.nn.Parameter]:
    """The parameters `Fp8MoEMethod.create_weights` registers (shapes do not matter here:
    the rule describes loader format from the layer's sizes)."""
    names = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv", *extra)
    return {n: torch.nn.Parameter(torch.empty(0), requires_grad=False) for n in names}


def _ctx(tp: tuple[int, int] = (1, 2)) -> LayerContext:
    return LayerContext(VllmRanks(tp[0], tp[1], 0, 1, 0, 1), {}, lambda name: name)


def _boxes(layer: Any, owned: dict[str, torch.nn.Parameter] | None = None) -> dict[str, Any]:
    described = routed_experts(_ctx(), PATH, layer, owned or _owned(layer))
    return {
        d.param.name.rpartition(".")[2]: (
            d.param.shape,
            d.param.dtype,
            {(p.hf_name, p.hf_box, p.param_box) for p in d.param.placements},
            {s.name: (s.shape, s.dtype) for s in d.specs},
            [r.param_box for r in d.param.padding],
        )
        for d in described
    }


def test_block_scales_split_like_the_weight_in_block_units_at_tp2_with_an_expert_map() -> None:
    # Rank 1 of TP 2 holds experts 3 and 1 (slots 0 and 1) of 4; I = 512, H = 256, so each
    # rank holds 256 intermediate rows = 2 blocks of 128, the hidden dimension 2 blocks.
    layer = _layer(expert_map=[-1, 1, -1, 0])
    got = _boxes(layer)
    shape, dtype, placements, specs, padding = got["w13_weight_scale_inv"]
    assert (shape, dtype, padding) == ((2, 4, 2), SCALE, [])
    gate = f"{PATH}.3.gate_proj.weight_scale_inv"
    up = f"{PATH}.3.up_proj.weight_scale_inv"
    assert (gate, ((2, 4), (0, 2)), ((0, 1), (0, 2), (0, 2))) in placements
    assert (up, ((2, 4), (0, 2)), ((0, 1), (2, 4), (0, 2))) in placements
    assert specs[gate] == ((4, 2), SCALE)
    assert len(placements) == 4
    assert {p[0].split(".")[5] for p in placements} == {"1", "3"}

    shape, dtype, placements, specs, _ = got["w2_weight_scale_inv"]
    assert (shape, dtype) == ((2, 2, 2), SCALE)
    down = f"{PATH}.1.down_proj.weight_scale_inv"
    assert (down, ((0, 2), (2, 4)), ((1, 2), (0, 2), (0, 2))) in placements
    assert specs[down] == ((2, 4), SCALE)

    # The weights are placed as for unquantized experts, in float8_e4m3fn.
    shape, dtype, placements, specs, _ = got["w13_weight"]
    assert (shape, dtype) == ((2, 512, 256), "float8_e4m3fn")
    up_w = f"{PATH}.1.up_proj.weight"
    assert (up_w, ((256, 512), (0, 256)), ((1, 2), (256, 512), (0, 256))) in placements
    assert specs[up_w] == ((512, 256), "float8_e4m3fn")
    shape, dtype, placements, _, _ = got["w2_weight"]
    assert (shape, dtype) == ((2, 256, 256), "float8_e4m3fn")
    down_w = f"{PATH}.3.down_proj.weight"
    assert (down_w, ((0, 256), (256, 512)), ((0, 1), (0, 256), (0, 256))) in placements


def test_at_tp1_a_last_partial_block_is_the_checkpoint_scales_own() -> None:
    # H = 200 and I = 320 are no multiples of 128: ceil(200/128) = 2, ceil(320/128) = 3.
    layer = _layer(hidden=200, inter=320, tp=(0, 1))
    got = _boxes(layer)
    shape, _, placements, specs, _ = got["w2_weight_scale_inv"]
    assert shape == (4, 2, 3)
    down = f"{PATH}.2.down_proj.weight_scale_inv"
    assert (down, ((0, 2), (0, 3)), ((2, 3), (0, 2), (0, 3))) in placements
    assert specs[down] == ((2, 3), SCALE)
    assert got["w13_weight_scale_inv"][0] == (4, 6, 2)


def test_a_tp_shard_off_a_block_boundary_is_refused_naming_the_tensor() -> None:
    # I = 384 at TP 2: 192 rows per rank, half a block.
    layer = _layer(inter=384)
    with pytest.raises(LayoutError, match="not a multiple of the FP8 block size 128") as err:
        routed_experts(_ctx(), PATH, layer, _owned(layer))
    assert "w13_weight_scale_inv" in str(err.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block": []}, "without block scales"),
        ({"activation_scheme": "static"}, "with static input scales"),
    ],
)
def test_per_tensor_fp8_and_static_input_scales_are_refused(
    change: dict[str, Any], message: str
) -> None:
    layer = _layer(**change)
    with pytest.raises(LayoutError, match=message) as err:
        routed_experts(_ctx(), PATH, layer, _owned(layer))
    assert PATH in str(err.value)


def test_expert_biases_are_refused_naming_the_parameter() -> None:
    layer = _layer()
    with pytest.raises(LayoutError, match="unexpected parameter") as err:
        routed_experts(_ctx(), PATH, layer, _owned(layer, ("w13_bias",)))
    assert f"{PATH}.w13_bias" in str(err.value)
