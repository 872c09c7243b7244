"""Per-layer rules: how vLLM's `load_weights` fills each parameter of one layer on this rank.

Each rule restates, as boxes, what the layer's `weight_loader` does with a checkpoint tensor
(vLLM 0.26 to 0.32, `model_executor/layers/linear.py`, `vocab_parallel_embedding.py`,
`fused_moe/routed_experts.py`). Layers are matched by exact class: a subclass may load
differently (LoRA wrappers, DCP / indexer variants), so it is rejected rather than guessed.
Parameter attributes that change what the loader does (`packed_dim`, `is_sharded_weight`,
`is_transposed`) are rejected too.

Linear layers are unquantized or FP8 with block scales (`Fp8LinearMethod` with
`weight_block_size`, an FP8-serialized checkpoint such as DeepSeek-V3's or Qwen3-FP8's): the
checkpoint then holds `weight` in float8_e4m3fn and `weight_scale_inv`, one scale per
`block_n x block_k` block, which the loader splits like the weight, in block units
(`linear.py: adjust_block_scale_shard`). FP8 kernels rewrite both after loading, so those
layers are always received into checkpoint-format staging and loaded through vLLM's
layerwise reload (`vllm_live`); the description is in loader format, built from the layer's
sizes rather than from the processed live parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import PaddingRegion, ParamLayout, Placement, VllmRanks
from refitplane.reshard.boxes import Box
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import dtype_name


@dataclass(frozen=True, slots=True)
class LayerContext:
    ranks: VllmRanks
    packed: Mapping[str, tuple[str, ...]]
    to_hf_name: Callable[[str], str]


@dataclass(frozen=True, slots=True)
class DescribedParam:
    param: ParamLayout
    specs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class _Band:
    """Rows `[index * rows, (index + 1) * rows)` of checkpoint tensor `hf_module`, whose
    full output size is `hf_rows`, stacked next in a column-parallel parameter."""

    hf_module: str
    rows: int
    index: int
    hf_rows: int


Owned = Mapping[str, torch.nn.Parameter]
Rule = Callable[[LayerContext, str, Any, Owned], list[DescribedParam]]

# Parameter attributes under which a loader does something a box cannot say.
_LOADER_FLAGS = ("packed_dim", "packed_factor", "is_sharded_weight", "is_transposed")


def describe_layer(
    ctx: LayerContext, path: str, module: torch.nn.Module, owned: Owned
) -> list[DescribedParam]:
    """The described parameters `module` registers itself (`owned`)."""
    rule = _rules().get(type(module))
    if rule is None:
        raise LayoutError(
            f"vLLM layer {type(module).__module__}.{type(module).__name__} at {path!r} is not "
            f"understood (parameters {sorted(owned)}); it cannot be described as boxes of "
            "checkpoint tensors",
            tensor=_join(path, sorted(owned)[0]),
        )
    for pname, param in owned.items():
        for flag in _LOADER_FLAGS:
            if getattr(param, flag, None) not in (None, False):
                raise LayoutError(
                    f"parameter has loader attribute {flag}={getattr(param, flag)!r}; "
                    "pre-sharded, packed or transposed parameters are not supported",
                    tensor=_join(path, pname),
                )
    return rule(ctx, path, module, owned)


def _rules() -> dict[type, Rule]:
    # vLLM is imported here, not at module level: this module is only used inside a worker.
    from vllm.model_executor.layers import layernorm, linear
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    rules: dict[type, Rule] = {
        linear.QKVParallelLinear: _qkv_parallel,
        linear.MergedColumnParallelLinear: _merged_column_parallel,
        linear.ColumnParallelLinear: _column_parallel,
        linear.RowParallelLinear: _row_parallel,
        linear.ReplicatedLinear: _replicated_linear,
        vocab.VocabParallelEmbedding: _vocab_parallel,
        vocab.ParallelLMHead: _vocab_parallel,
        RoutedExperts: _routed_experts,
        torch.nn.LayerNorm: _replicated,
    }
    for name in ("RMSNorm", "GemmaRMSNorm", "LayerNorm"):
        norm = getattr(layernorm, name, None)
        if norm is not None:
            rules[norm] = _replicated
    try:
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    except ImportError:  # vLLM versions without a dedicated router layer
        pass
    else:
        rules[GateLinear] = _replicated_linear
    return rules


# --- helpers -------------------------------------------------------------------------------


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _dtype(param: torch.Tensor) -> str:
    return dtype_name(param.dtype)


def _expect_params(path: str, owned: Owned, allowed: Sequence[str]) -> None:
    extra = sorted(set(owned) - set(allowed))
    if extra:
        raise LayoutError(
            f"unexpected parameter on a {', '.join(allowed)} layer; only {list(allowed)} "
            "are understood",
            tensor=_join(path, extra[0]),
        )


@dataclass(frozen=True, slots=True)
class _WeightFormat:
    """How a linear layer's checkpoint stores its weight: as the live parameter's dtype
    (`block` None) or as FP8 with one `scale_dtype` scale per `block` (rows, cols)."""

    block: tuple[int, int] | None = None
    scale_dtype: str = "float32"


FP8_WEIGHT_DTYPE = "float8_e4m3fn"
BLOCK_SCALE_NAME = "weight_scale_inv"


def _linear_format(path: str, layer: Any, owned: Owned) -> _WeightFormat:
    method = getattr(layer, "quant_method", None)
    kind = type(method).__name__
    if kind == "UnquantizedLinearMethod":
        _expect_params(path, owned, ("weight", "bias"))
        return _WeightFormat()
    block = getattr(method, "weight_block_size", None)
    if kind == "Fp8LinearMethod" and block is not None and len(block) == 2:
        scale = "float8_e8m0fnu" if getattr(method, "is_scale_e8m0", False) else "float32"
        return _WeightFormat((int(block[0]), int(block[1])), scale)
    raise LayoutError(
        f"layer uses quant method {kind}"
        + (" without block scales" if kind == "Fp8LinearMethod" else "")
        + "; linear layers must be unquantized or FP8 with block scales (weight_block_size)",
        tensor=_join(path, sorted(owned)[0] if owned else "weight"),
    )


def _blocks(size: int, block: int, what: str, tensor: str) -> int:
    """`size` in units of `block`; a shard must start and end on a block boundary."""
    if size % block:
        raise LayoutError(
            f"{what} {size} is not a multiple of the FP8 block size {block}", tensor=tensor
        )
    return size // block


def _ceil_blocks(size: int, block: int) -> int:
    return -(-size // block)


def _expect_unquantized(path: str, layer: Any, owned: Owned, method: str) -> None:
    quant = type(getattr(layer, "quant_method", None)).__name__
    if quant != method:
        raise LayoutError(
            f"layer uses quant method {quant}; the direct layout covers unquantized "
            "weights only (quantized weights go through vLLM's layerwise reload)",
            tensor=_join(path, sorted(owned)[0]),
        )


def _layer_tp(ctx: LayerContext, path: str, layer: Any) -> tuple[int, int]:
    """The layer's own TP coordinates (what its loader narrows by), checked against vLLM's
    parallel state unless the layer opted out of the TP group (`disable_tp`, own group)."""
    # vLLM 0.26's VocabParallelEmbedding has no tp_rank attribute: the group's rank is it.
    tp_rank = int(getattr(layer, "tp_rank", ctx.ranks.tp_rank))
    tp_size = int(getattr(layer, "tp_size", ctx.ranks.tp_size))
    own_group = getattr(layer, "disable_tp", False) or getattr(layer, "parallel_group", None)
    if not own_group and (tp_rank, tp_size) != (ctx.ranks.tp_rank, ctx.ranks.tp_size):
        raise LayoutError(
            f"layer is at TP rank {tp_rank}/{tp_size} but vLLM's parallel state says "
            f"{ctx.ranks.tp_rank}/{ctx.ranks.tp_size}",
            tensor=path,
        )
    return tp_rank, tp_size


def _hf_module(ctx: LayerContext, path: str, name: str) -> str:
    """The checkpoint module name of sibling `name` of the vLLM module at `path`."""
    parent = path.rpartition(".")[0]
    return _join(parent, name)


def _packed_names(ctx: LayerContext, path: str, count: int) -> tuple[str, ...]:
    local = path.rpartition(".")[2]
    names = ctx.packed.get(local)
    if names is None or len(names) != count:
        raise LayoutError(
            f"fused layer {local!r} has {count} parts but the packed-modules mapping gives "
            f"{list(names) if names else 'none'}",
            tensor=path,
        )
    return names


def _param_spec(
    ctx: LayerContext, hf_module: str, pname: str, shape: Sequence[int], dtype: str
) -> TensorSpec:
    return TensorSpec.create(ctx.to_hf_name(_join(hf_module, pname)), list(shape), dtype)


def _column_bands(
    ctx: LayerContext, path: str, layer: Any, owned: Owned, bands: Sequence[_Band]
) -> list[DescribedParam]:
    """A column-parallel parameter (weight rows / bias entries) stacking `bands`; for FP8
    layers also the block scales, whose rows stack the same bands in block units."""
    fmt = _linear_format(path, layer, owned)
    cols = int(layer.input_size_per_partition)
    for band in bands:
        if (band.index + 1) * band.rows > band.hf_rows:
            raise LayoutError(
                f"band {band.index} of {band.rows} rows exceeds the {band.hf_rows} rows "
                "of the checkpoint tensor",
                tensor=_join(path, "weight"),
            )
    out: list[DescribedParam] = []
    if "bias" in owned:
        out.append(_stacked(ctx, path, "bias", _dtype(owned["bias"]), bands, None))
    if fmt.block is None:
        out.append(_stacked(ctx, path, "weight", _dtype(owned["weight"]), bands, cols))
        return out
    block_n, block_k = fmt.block
    out.append(_stacked(ctx, path, "weight", FP8_WEIGHT_DTYPE, bands, cols))
    scale_name = _join(path, BLOCK_SCALE_NAME)
    scale_bands = [
        _Band(
            b.hf_module,
            _blocks(b.rows, block_n, f"{b.hf_module} shard of rows", scale_name),
            b.index,
            _ceil_blocks(b.hf_rows, block_n),
        )
        for b in bands
    ]
    # A column-parallel layer reads its whole input: the scale's columns are not split.
    scale_cols = _ceil_blocks(cols, block_k)
    out.append(_stacked(ctx, path, BLOCK_SCALE_NAME, fmt.scale_dtype, scale_bands, scale_cols))
    return out


def _stacked(
    ctx: LayerContext,
    path: str,
    pname: str,
    dtype: str,
    bands: Sequence[_Band],
    cols: int | None,
) -> DescribedParam:
    """One parameter whose rows stack `bands` of checkpoint tensors `<band>.<pname>`, every
    one whole along its `cols` columns (None for 1-D parameters)."""
    placements: list[Placement] = []
    specs: list[TensorSpec] = []
    offset = 0
    for band in bands:
        hf_rows = (band.index * band.rows, (band.index + 1) * band.rows)
        local_rows = (offset, offset + band.rows)
        if cols is None:
            spec = _param_spec(ctx, band.hf_module, pname, (band.hf_rows,), dtype)
            placements.append(Placement(spec.name, (hf_rows,), (local_rows,)))
        else:
            spec = _param_spec(ctx, band.hf_module, pname, (band.hf_rows, cols), dtype)
            placements.append(Placement(spec.name, (hf_rows, (0, cols)), (local_rows, (0, cols))))
        specs.append(spec)
        offset += band.rows
    shape = (offset,) if cols is None else (offset, cols)
    return DescribedParam(
        ParamLayout(_join(path, pname), shape, dtype, tuple(placements)), tuple(specs)
    )


# --- rules -----------------------------------------------------------------------------------


def _qkv_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`QKVParallelLinear.weight_loader`: rows `[q | k | v]`; q heads split by TP; when TP >
    the number of KV heads each rank holds one KV head, `tp_rank // num_kv_head_replicas`."""
    tp_rank, _ = _layer_tp(ctx, path, layer)
    q_name, k_name, v_name = _packed_names(ctx, path, 3)
    head, v_head = int(layer.head_size), int(getattr(layer, "v_head_size", layer.head_size))
    heads, kv_heads = int(layer.num_heads), int(layer.num_kv_heads)
    kv_rank = tp_rank // int(layer.num_kv_head_replicas)
    total_heads, total_kv = int(layer.total_num_heads), int(layer.total_num_kv_heads)
    bands = [
        _Band(_hf_module(ctx, path, q_name), heads * head, tp_rank, total_heads * head),
        _Band(_hf_module(ctx, path, k_name), kv_heads * head, kv_rank, total_kv * head),
        _Band(_hf_module(ctx, path, v_name), kv_heads * v_head, kv_rank, total_kv * v_head),
    ]
    return _column_bands(ctx, path, layer, owned, bands)


def _merged_column_parallel(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    """`MergedColumnParallelLinear.weight_loader`: part i holds rows
    `[tp_rank * n_i / tp, (tp_rank + 1) * n_i / tp)` of checkpoint tensor i, parts stacked."""
    tp_rank, tp_size = _layer_tp(ctx, path, layer)
    sizes = [int(n) for n in layer.output_sizes]
    names = _packed_names(ctx, path, len(sizes))
    bands = []
    for name, size in zip(names, sizes, strict=True):
        if size % tp_size:
            raise LayoutError(f"output size {size} is not divisible by TP {tp_size}", tensor=path)
        bands.append(_Band(_hf_module(ctx, path, name), size // tp_size, tp_rank, size))
    return _column_bands(ctx, path, layer, owned, bands)


def _column_parallel(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    tp_rank, _ = _layer_tp(ctx, path, layer)
    rows = int(layer.output_size_per_partition)
    return _column_bands(
        ctx, path, layer, owned, [_Band(path, rows, tp_rank, int(layer.output_size))]
    )


def _row_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`RowParallelLinear.weight_loader`: weight columns split by TP; the bias is whole. FP8
    block scales split their columns the same way, in block units."""
    fmt = _linear_format(path, layer, owned)
    tp_rank, _ = _layer_tp(ctx, path, layer)
    rows, cols = int(layer.output_size_per_partition), int(layer.input_size_per_partition)
    out = []
    if "bias" in owned:
        out.append(_whole(ctx, path, "bias", _dtype(owned["bias"]), (rows,)))
    weight_dtype = _dtype(owned["weight"]) if fmt.block is None else FP8_WEIGHT_DTYPE
    out.append(
        _column_slice(
            ctx, path, "weight", weight_dtype, rows, (cols, int(layer.input_size)), tp_rank
        )
    )
    if fmt.block is not None:
        block_n, block_k = fmt.block
        scale_name = _join(path, BLOCK_SCALE_NAME)
        scale_rows = _ceil_blocks(rows, block_n)
        local_cols = _blocks(cols, block_k, "input columns per rank", scale_name)
        hf_cols = _ceil_blocks(int(layer.input_size), block_k)
        out.append(
            _column_slice(
                ctx,
                path,
                BLOCK_SCALE_NAME,
                fmt.scale_dtype,
                scale_rows,
                (local_cols, hf_cols),
                tp_rank,
            )
        )
    return out


def _column_slice(
    ctx: LayerContext,
    path: str,
    pname: str,
    dtype: str,
    rows: int,
    cols: tuple[int, int],
    tp_rank: int,
) -> DescribedParam:
    """Columns `[tp_rank * local, (tp_rank + 1) * local)` of a `(rows, checkpoint columns)`
    checkpoint tensor, all its rows; `cols` is (local, checkpoint) columns."""
    local_cols, hf_cols = cols
    spec = _param_spec(ctx, path, pname, (rows, hf_cols), dtype)
    hf_box = ((0, rows), (tp_rank * local_cols, (tp_rank + 1) * local_cols))
    placement = Placement(spec.name, hf_box, ((0, rows), (0, local_cols)))
    return DescribedParam(
        ParamLayout(_join(path, pname), (rows, local_cols), dtype, (placement,)), (spec,)
    )


def _replicated_linear(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    fmt = _linear_format(path, layer, owned)
    if path.rpartition(".")[2] in ctx.packed:
        raise LayoutError("fused replicated linear layers are not supported", tensor=path)
    rows, cols = int(layer.output_size), int(layer.input_size)
    out = []
    if "bias" in owned:
        out.append(_whole(ctx, path, "bias", _dtype(owned["bias"]), (rows,)))
    if fmt.block is None:
        out.append(_whole(ctx, path, "weight", _dtype(owned["weight"]), (rows, cols)))
    else:
        block_n, block_k = fmt.block
        out.append(_whole(ctx, path, "weight", FP8_WEIGHT_DTYPE, (rows, cols)))
        scale_shape = (_ceil_blocks(rows, block_n), _ceil_blocks(cols, block_k))
        out.append(_whole(ctx, path, BLOCK_SCALE_NAME, fmt.scale_dtype, scale_shape))
    return out


def _replicated(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """Norms: every rank holds the whole tensor (the live shape is the loader's shape)."""
    _expect_params(path, owned, ("weight", "bias"))
    return [
        _whole(ctx, path, pname, _dtype(param), tuple(param.shape))
        for pname, param in owned.items()
    ]


def _whole(
    ctx: LayerContext, path: str, pname: str, dtype: str, shape: tuple[int, ...]
) -> DescribedParam:
    spec = _param_spec(ctx, path, pname, shape, dtype)
    placement = Placement(spec.name, _full(shape), _full(shape))
    return DescribedParam(ParamLayout(_join(path, pname), shape, dtype, (placement,)), (spec,))


def _vocab_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`VocabParallelEmbedding.weight_loader`: this rank's rows of the real vocabulary first,
    then padding rows (the vocabulary is padded to a multiple of 64, then split by TP)."""
    _expect_params(path, owned, ("weight",))
    _expect_unquantized(path, layer, owned, "UnquantizedEmbeddingMethod")
    _layer_tp(ctx, path, layer)
    indices = layer.shard_indices
    if int(indices.added_vocab_end_index) > int(indices.added_vocab_start_index):
        raise LayoutError(
            "added (LoRA) vocabulary rows are not supported", tensor=_join(path, "weight")
        )
    param = owned["weight"]
    dtype = _dtype(param)
    dim = int(layer.embedding_dim)
    local_rows = int(layer.num_embeddings_per_partition)
    start, stop = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
    real = stop - start
    spec = _param_spec(ctx, path, "weight", (int(layer.org_vocab_size), dim), dtype)
    placements = (
        (Placement(spec.name, ((start, stop), (0, dim)), ((0, real), (0, dim))),) if real else ()
    )
    padding = (
        (PaddingRegion(((real, local_rows), (0, dim)), "vocabulary padding"),)
        if local_rows > real
        else ()
    )
    name = _join(path, "weight")
    return [
        DescribedParam(ParamLayout(name, (local_rows, dim), dtype, placements, padding), (spec,))
    ]


def _routed_experts(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`RoutedExperts.weight_loader` for per-expert checkpoints: local expert `l` (global `g`
    by the layer's expert map) holds, in `w13_weight[l]`, rows `tp_rank * I/tp` of
    `experts.g.gate_proj` then the same rows of `up_proj`, and in `w2_weight[l]` the same
    columns of `down_proj`. Sizes padded by the MoE backend are padding."""
    _expect_params(path, owned, ("w13_weight", "w2_weight"))
    _expect_unquantized(path, layer, owned, "UnquantizedFusedMoEMethod")
    cfg = layer.moe_config
    par = cfg.moe_parallel_config
    param_name = _join(path, "w13_weight")
    if par.enable_eplb or int(cfg.num_experts) != int(cfg.num_logical_experts):
        raise LayoutError("EPLB / redundant experts are not supported", tensor=param_name)
    if not cfg.is_act_and_mul or getattr(cfg, "tp_shard_with_padding", False):
        raise LayoutError("only gated MoE without TP-shard padding is supported", tensor=param_name)
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
        return _param_spec(ctx, _join(prefix, f"{g}.{ckpt}"), "weight", shape, dtype)

    out = []
    for pname, param in owned.items():
        dtype = _dtype(param)
        placements: list[Placement] = []
        specs: list[TensorSpec] = []
        padding: list[PaddingRegion] = []
        everyone = (0, n_local)
        if pname == "w13_weight":
            shape = (n_local, 2 * inter_p, hidden_p)
            for g, slot in local:
                for ckpt, row0 in ((gate, 0), (up, inter_p)):
                    spec = spec_of(g, ckpt, (inter, hidden), dtype)
                    specs.append(spec)
                    region = ((slot, slot + 1), (row0, row0 + per_rank), (0, hidden))
                    placements.append(_expert_placement(spec.name, (cols, (0, hidden)), region))
            if inter_p > per_rank:
                for row0 in (0, inter_p):
                    padding.append(
                        PaddingRegion(
                            (everyone, (row0 + per_rank, row0 + inter_p), (0, hidden)),
                            "MoE intermediate padding",
                        )
                    )
            if hidden_p > hidden:
                padding.append(
                    PaddingRegion(
                        (everyone, (0, 2 * inter_p), (hidden, hidden_p)), "MoE hidden padding"
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
                ParamLayout(_join(path, pname), shape, dtype, tuple(placements), tuple(padding)),
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
