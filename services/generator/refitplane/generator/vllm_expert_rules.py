"""Rules of vLLM's mixture-of-experts layers: the routed experts' fused `w13_weight` /
`w2_weight` of this rank's local experts (`fused_moe/routed_experts.py`, TP and EP), and the
router (`GateLinear`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import PaddingRegion, ParamLayout, Placement
from refitplane.generator.vllm_linear_rules import replicated_linear
from refitplane.generator.vllm_rule_parts import (
    DescribedParam,
    dtype_of,
    expect_params,
    expect_unquantized,
    join_name,
    param_spec,
    whole_param,
)
from refitplane.reshard.boxes import Box
from refitplane.reshard.layout import TensorSpec

if TYPE_CHECKING:
    from refitplane.generator.vllm_rule_parts import LayerContext, Owned


def router(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """An MoE router (`GateLinear`): a replicated linear, plus, for DeepSeek-V3-style
    noaux_tc routing, the whole `e_score_correction_bias` vector the model hangs on it."""
    bias_name = "e_score_correction_bias"
    linear = {k: v for k, v in owned.items() if k != bias_name}
    out = replicated_linear(ctx, path, layer, linear)
    if bias_name in owned:
        param = owned[bias_name]
        out.append(whole_param(ctx, path, bias_name, dtype_of(param), tuple(param.shape)))
    return out


def routed_experts(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`RoutedExperts.weight_loader` for per-expert checkpoints: local expert `l` (global `g`
    by the layer's expert map) holds, in `w13_weight[l]`, rows `tp_rank * I/tp` of
    `experts.g.gate_proj` then the same rows of `up_proj`, and in `w2_weight[l]` the same
    columns of `down_proj`. A non-gated MoE (NemotronH's ReLU² experts) has no gate: its
    `w13_weight[l]` holds only those rows of the one up projection, which the model names as
    the layer's checkpoint "gate" (`ckpt_gate_proj_name`, e.g. `up_proj`). Sizes padded by
    the MoE backend are padding."""
    expect_params(path, owned, ("w13_weight", "w2_weight"))
    expect_unquantized(path, layer, owned, "UnquantizedFusedMoEMethod")
    cfg = layer.moe_config
    par = cfg.moe_parallel_config
    param_name = join_name(path, "w13_weight")
    if par.enable_eplb or int(cfg.num_experts) != int(cfg.num_logical_experts):
        raise LayoutError("EPLB / redundant experts are not supported", tensor=param_name)
    if getattr(cfg, "tp_shard_with_padding", False):
        raise LayoutError("MoE with TP-shard padding is not supported", tensor=param_name)
    gated = bool(cfg.is_act_and_mul)
    tp_rank, tp_size = int(par.tp_rank), int(par.tp_size)
    hidden = int(cfg.hidden_dim_unpadded or cfg.hidden_dim)
    inter = int(cfg.intermediate_size)
    if inter % tp_size:
        raise LayoutError(
            f"MoE intermediate size {inter} is not divisible by its TP size {tp_size}",
            tensor=param_name,
        )
    per_rank = inter // tp_size
    hidden_p, inter_p = int(layer.hidden_size), int(layer.intermediate_size_per_partition)
    local = _local_experts(layer, param_name)
    n_local = len(local)
    cols = (tp_rank * per_rank, (tp_rank + 1) * per_rank)
    prefix = str(layer.layer_name)
    gate, up, down = layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name

    def spec_of(g: int, ckpt: str, shape: tuple[int, int], dtype: str) -> TensorSpec:
        return param_spec(ctx, join_name(prefix, f"{g}.{ckpt}"), "weight", shape, dtype)

    out = []
    for pname, param in owned.items():
        dtype = dtype_of(param)
        placements: list[Placement] = []
        specs: list[TensorSpec] = []
        padding: list[PaddingRegion] = []
        everyone = (0, n_local)
        if pname == "w13_weight":
            halves = ((gate, 0), (up, inter_p)) if gated else ((gate, 0),)
            shape = (n_local, len(halves) * inter_p, hidden_p)
            for g, slot in local:
                for ckpt, row0 in halves:
                    spec = spec_of(g, ckpt, (inter, hidden), dtype)
                    specs.append(spec)
                    region = ((slot, slot + 1), (row0, row0 + per_rank), (0, hidden))
                    placements.append(_expert_placement(spec.name, (cols, (0, hidden)), region))
            if inter_p > per_rank:
                for _, row0 in halves:
                    padding.append(
                        PaddingRegion(
                            (everyone, (row0 + per_rank, row0 + inter_p), (0, hidden)),
                            "MoE intermediate padding",
                        )
                    )
            if hidden_p > hidden:
                padding.append(
                    PaddingRegion(
                        (everyone, (0, shape[1]), (hidden, hidden_p)), "MoE hidden padding"
                    )
                )
        else:
            shape = (n_local, hidden_p, inter_p)
            for g, slot in local:
                spec = spec_of(g, down, (hidden, inter), dtype)
                specs.append(spec)
                region = ((slot, slot + 1), (0, hidden), (0, per_rank))
                placements.append(_expert_placement(spec.name, ((0, hidden), cols), region))
            if inter_p > per_rank:
                padding.append(
                    PaddingRegion(
                        (everyone, (0, hidden), (per_rank, inter_p)), "MoE intermediate padding"
                    )
                )
            if hidden_p > hidden:
                padding.append(
                    PaddingRegion(
                        (everyone, (hidden, hidden_p), (0, per_rank)), "MoE hidden padding"
                    )
                )
        out.append(
            DescribedParam(
                ParamLayout(
                    join_name(path, pname), shape, dtype, tuple(placements), tuple(padding)
                ),
                tuple(specs),
            )
        )
    return out


def _expert_placement(hf_name: str, hf_box: Box, region: Box) -> Placement:
    """An expert's 2-D checkpoint box at one index of a 3-D `[E_local, ...]` parameter."""
    return Placement(hf_name, hf_box, region, squeeze=(0,))


def _local_experts(layer: Any, param_name: str) -> list[tuple[int, int]]:
    """(global expert, local slot) pairs, from the layer's expert map when it has one
    (EP placements need not be contiguous), else every expert is local in order."""
    n_global = int(layer.moe_config.num_logical_experts)
    n_local = int(layer.local_num_experts)
    expert_map = getattr(layer, "_expert_map", None)
    if expert_map is None:
        if n_local != n_global:
            raise LayoutError(
                f"{n_local} of {n_global} experts are local but the layer has no expert map",
                tensor=param_name,
            )
        return [(g, g) for g in range(n_global)]
    values = [int(v) for v in expert_map.tolist()]
    if len(values) != n_global:
        raise LayoutError(
            f"expert map has {len(values)} entries for {n_global} experts", tensor=param_name
        )
    pairs = [(g, slot) for g, slot in enumerate(values) if slot >= 0]
    if sorted(slot for _, slot in pairs) != list(range(n_local)):
        raise LayoutError(
            f"expert map {values} does not fill the {n_local} local slots exactly once",
            tensor=param_name,
        )
    return pairs
