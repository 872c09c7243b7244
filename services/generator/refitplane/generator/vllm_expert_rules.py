"""Rules of vLLM's mixture-of-experts layers: the routed experts' fused `w13_weight` /
`w2_weight` of this rank's local experts (`fused_moe/routed_experts.py`, TP and EP),
unquantized or block-FP8 (`Fp8MoEMethod` with `weight_block_size`: float8_e4m3fn weights and
their `weight_scale_inv` block scales, split like the weight in block units, as the linear
rules split theirs), and the router (`GateLinear`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import PaddingRegion, ParamLayout, Placement
from refitplane.generator.vllm_linear_rules import (
    BLOCK_SCALE_NAME,
    FP8_WEIGHT_DTYPE,
    WeightFormat,
    ceil_blocks,
    fp8_block_format,
    replicated_linear,
    whole_blocks,
)
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


@dataclass(frozen=True, slots=True)
class _Experts:
    """This rank's share of a routed-experts layer, in elements: `per_rank` of the
    checkpoint's `inter` intermediate rows (gate/up rows, down columns), stored in
    `inter_p` (padded) of the parameter; `hidden` of the parameter's `hidden_p`."""

    name: str  # the layer's checkpoint prefix (`model.layers.3.mlp.experts`)
    gate_proj: str  # the checkpoint's expert module names (`ckpt_*_proj_name`)
    up_proj: str
    down_proj: str
    local: list[tuple[int, int]]
    gated: bool
    tp_rank: int
    tp_size: int
    hidden: int
    hidden_p: int
    inter: int
    per_rank: int
    inter_p: int


def routed_experts(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`RoutedExperts.weight_loader` for per-expert checkpoints: local expert `l` (global `g`
    by the layer's expert map) holds, in `w13_weight[l]`, rows `tp_rank * I/tp` of
    `experts.g.gate_proj` then the same rows of `up_proj`, and in `w2_weight[l]` the same
    columns of `down_proj`. A non-gated MoE (NemotronH's ReLU² experts) has no gate: its
    `w13_weight[l]` holds only those rows of the one up projection, which the model names as
    the layer's checkpoint "gate" (`ckpt_gate_proj_name`, e.g. `up_proj`). Sizes padded by
    the MoE backend are padding.

    Block-FP8 experts (`Fp8MoEMethod` with `weight_block_size` [bn, bk], Qwen3-FP8 /
    DeepSeek-V3 checkpoints) hold float8_e4m3fn `w13_weight` / `w2_weight` placed as above,
    and `w13_weight_scale_inv` [E, 2*ceil(I_p/bn), ceil(H/bk)] / `w2_weight_scale_inv`
    [E, ceil(H/bn), ceil(I_p/bk)] placed the same way in block units from each expert's
    `<proj>.weight_scale_inv` (`_load_model_weight_or_group_weight_scale`): a TP shard
    must start and end on a block boundary. Per-tensor FP8, static input scales and expert
    biases are not described (fallback)."""
    fmt = _experts_format(path, layer, owned)
    cfg = layer.moe_config
    par = cfg.moe_parallel_config
    param_name = join_name(path, "w13_weight")
    if par.enable_eplb or int(cfg.num_experts) != int(cfg.num_logical_experts):
        raise LayoutError("EPLB / redundant experts are not supported", tensor=param_name)
    if getattr(cfg, "tp_shard_with_padding", False):
        raise LayoutError("MoE with TP-shard padding is not supported", tensor=param_name)
    tp_size = int(par.tp_size)
    inter = int(cfg.intermediate_size)
    if inter % tp_size:
        raise LayoutError(
            f"MoE intermediate size {inter} is not divisible by its TP size {tp_size}",
            tensor=param_name,
        )
    experts = _Experts(
        name=str(layer.layer_name),
        gate_proj=str(layer.ckpt_gate_proj_name),
        up_proj=str(layer.ckpt_up_proj_name),
        down_proj=str(layer.ckpt_down_proj_name),
        local=_local_experts(layer, param_name),
        gated=bool(cfg.is_act_and_mul),
        tp_rank=int(par.tp_rank),
        tp_size=tp_size,
        hidden=int(cfg.hidden_dim_unpadded or cfg.hidden_dim),
        hidden_p=int(layer.hidden_size),
        inter=inter,
        per_rank=inter // tp_size,
        inter_p=int(layer.intermediate_size_per_partition),
    )
    out = []
    for pname, param in owned.items():
        if fmt.block is None:
            dtype, ckpt_name, block = dtype_of(param), "weight", (1, 1)
        elif pname.endswith(BLOCK_SCALE_NAME):
            dtype, ckpt_name, block = fmt.scale_dtype, BLOCK_SCALE_NAME, fmt.block
        else:
            dtype, ckpt_name, block = FP8_WEIGHT_DTYPE, "weight", (1, 1)
        w13 = pname.startswith("w13_")
        out.append(
            _expert_param(ctx, join_name(path, pname), experts, w13, ckpt_name, dtype, block)
        )
    return out


def _experts_format(path: str, layer: Any, owned: Owned) -> WeightFormat:
    """Unquantized experts, or block-FP8 ones (`Fp8MoEMethod` with `weight_block_size`);
    anything else is refused, naming the layer's first parameter."""
    method = getattr(layer, "quant_method", None)
    kind = type(method).__name__
    if kind == "Fp8MoEMethod":
        fmt = fp8_block_format(method)
        static = getattr(getattr(method, "quant_config", None), "activation_scheme", "dynamic")
        if fmt is not None and static != "static":
            scales = (f"w13_{BLOCK_SCALE_NAME}", f"w2_{BLOCK_SCALE_NAME}")
            expect_params(path, owned, ("w13_weight", "w2_weight", *scales))
            return fmt
        raise LayoutError(
            f"layer uses quant method {kind} "
            + ("with static input scales" if fmt is not None else "without block scales")
            + "; FP8 experts must have block scales (weight_block_size) and dynamic "
            "activation scales",
            tensor=join_name(path, sorted(owned)[0] if owned else "w13_weight"),
        )
    expect_params(path, owned, ("w13_weight", "w2_weight"))
    expect_unquantized(path, layer, owned, "UnquantizedFusedMoEMethod")
    return WeightFormat()


def _expert_param(
    ctx: LayerContext,
    param_name: str,
    experts: _Experts,
    w13: bool,
    ckpt_name: str,
    dtype: str,
    block: tuple[int, int],
) -> DescribedParam:
    """`w13_*` (`w13` True) or `w2_*` of the local experts, from each expert's checkpoint
    tensors `<proj>.<ckpt_name>`, in units of `block` (rows, cols) of the 2-D expert
    matrix: elements for weights (1, 1), FP8 blocks for `weight_scale_inv`."""
    block_n, block_k = block
    inter_block = block_n if w13 else block_k
    hidden_block = block_k if w13 else block_n
    # A rank's intermediate shard in block units; with TP 1 it is the whole tensor, so a
    # last partial block is the checkpoint's too.
    if experts.tp_size == 1:
        per_rank = ceil_blocks(experts.per_rank, inter_block)
    else:
        what = "MoE intermediate rows per rank" if w13 else "MoE intermediate columns per rank"
        per_rank = whole_blocks(experts.per_rank, inter_block, what, param_name)
    inter = ceil_blocks(experts.inter, inter_block)
    inter_p = ceil_blocks(experts.inter_p, inter_block)
    hidden = ceil_blocks(experts.hidden, hidden_block)
    hidden_p = ceil_blocks(experts.hidden_p, hidden_block)
    shard = (experts.tp_rank * per_rank, (experts.tp_rank + 1) * per_rank)
    n_local = len(experts.local)
    everyone = (0, n_local)
    placements: list[Placement] = []
    specs: list[TensorSpec] = []
    padding: list[PaddingRegion] = []

    def spec_of(g: int, proj: str, shape: tuple[int, int]) -> TensorSpec:
        return param_spec(ctx, join_name(experts.name, f"{g}.{proj}"), ckpt_name, shape, dtype)

    if w13:
        gate, up = experts.gate_proj, experts.up_proj
        halves = ((gate, 0), (up, inter_p)) if experts.gated else ((gate, 0),)
        shape = (n_local, len(halves) * inter_p, hidden_p)
        for g, slot in experts.local:
            for proj, row0 in halves:
                spec = spec_of(g, proj, (inter, hidden))
                specs.append(spec)
                region = ((slot, slot + 1), (row0, row0 + per_rank), (0, hidden))
                placements.append(_expert_placement(spec.name, (shard, (0, hidden)), region))
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
                PaddingRegion((everyone, (0, shape[1]), (hidden, hidden_p)), "MoE hidden padding")
            )
    else:
        shape = (n_local, hidden_p, inter_p)
        for g, slot in experts.local:
            spec = spec_of(g, experts.down_proj, (hidden, inter))
            specs.append(spec)
            region = ((slot, slot + 1), (0, hidden), (0, per_rank))
            placements.append(_expert_placement(spec.name, ((0, hidden), shard), region))
        if inter_p > per_rank:
            padding.append(
                PaddingRegion(
                    (everyone, (0, hidden), (per_rank, inter_p)), "MoE intermediate padding"
                )
            )
        if hidden_p > hidden:
            padding.append(
                PaddingRegion((everyone, (hidden, hidden_p), (0, per_rank)), "MoE hidden padding")
            )
    return DescribedParam(
        ParamLayout(param_name, shape, dtype, tuple(placements), tuple(padding)), tuple(specs)
    )


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
