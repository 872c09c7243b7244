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
    # Fused vLLM modules (by path) whose checkpoint tensor is stored fused under their own
    # name without a packed-modules entry saying so (Mamba2's `in_proj`).
    self_fused: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class DescribedParam:
    param: ParamLayout
    specs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class _Band:
    """Rows `[index * rows, (index + 1) * rows)` of a part of `hf_rows` rows of checkpoint
    tensor `hf_module`, stacked next in a column-parallel parameter. The part starts at row
    `offset` of a tensor of `tensor_rows` rows when the checkpoint stores several parts
    fused (Phi-3's `qkv_proj` / `gate_up_proj`); otherwise it is the whole tensor."""

    hf_module: str
    rows: int
    index: int
    hf_rows: int
    offset: int = 0
    tensor_rows: int = 0

    @property
    def total_rows(self) -> int:
        return self.tensor_rows or self.hf_rows


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
        loader = getattr(loader_template(module, pname, param), "weight_loader", None)
        if loader is not None and not _standard_loader(module, loader, type(module).__name__):
            raise LayoutError(
                f"parameter has its own weight loader "
                f"({getattr(loader, '__qualname__', type(loader).__name__)}), not its layer's; "
                "what it does is not described by the layer's rule",
                tensor=_join(path, pname),
            )
    return rule(ctx, path, module, owned)


def loader_template(
    owner: torch.nn.Module, pname: str, live: torch.Tensor | None
) -> torch.Tensor | None:
    """The parameter as `create_weights` made it (loader format: shape, dtype and loader
    attributes), which vLLM records for layerwise reload because post-load processing may
    replace it; the live parameter where nothing was recorded (`bias`, vLLM without
    layerwise reload)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return live
    info = LAYERWISE_INFO.get(owner)
    recorded = info.restore_metadata[0].get(pname) if info is not None else None
    return recorded if recorded is not None else live


def check_loader_format(layer: torch.nn.Module, param: ParamLayout) -> None:
    """The described shape and dtype are those vLLM's loader writes the parameter in (a rule
    applied to a layer it does not fit describes the wrong shape)."""
    pname = param.name.rpartition(".")[2]
    template = loader_template(layer, pname, getattr(layer, pname, None))
    if template is None:
        return
    shape, dtype = tuple(int(n) for n in template.shape), dtype_name(template.dtype)
    if (shape, dtype) != (param.shape, param.dtype):
        raise LayoutError(
            f"described as {list(param.shape)} {param.dtype}, but vLLM's loader writes "
            f"{list(shape)} {dtype}",
            tensor=param.name,
        )


# Loader functions (by qualified name) that a layer class's rule restates, beside its own
# methods: Mamba2's gated norm is an even row split (`sharded_weight_loader(0)`).
_RESTATED_LOADERS: dict[str, frozenset[str]] = {
    "Mixer2RMSNormGated": frozenset({"sharded_weight_loader.<locals>.loader"}),
}


def _standard_loader(layer: torch.nn.Module, loader: Any, layer_class: str) -> bool:
    """A method of the layer's own class (bound to it, or to the placeholder vLLM binds
    recorded loaders to), vLLM's default loader, or a loader the class's rule restates."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    # After a layerwise reload vLLM leaves its deferring wrapper on the recorded loaders.
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if loader is default_weight_loader:
        return True
    if getattr(loader, "__qualname__", "") in _RESTATED_LOADERS.get(layer_class, frozenset()):
        return True
    func = getattr(loader, "__func__", None)
    name = getattr(func, "__name__", "")
    return func is not None and getattr(type(layer), name, None) is func


def has_rule(layer: torch.nn.Module) -> bool:
    """Whether a fast-path rule exists for the layer's class."""
    return type(layer) in _rules()


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
        rules[GateLinear] = _router
    try:
        from vllm.model_executor.layers.mamba.mamba_mixer2 import Mixer2RMSNormGated
    except ImportError:
        pass
    else:
        rules[Mixer2RMSNormGated] = _row_sharded_vector
    try:
        # DeepSeek-V3 / Kimi-K2 MLA with q_lora_rank: [q_a_proj; kv_a_proj_with_mqa] fused,
        # a MergedColumnParallelLinear with TP disabled (its own loader unchanged).
        from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear
    except ImportError:  # vLLM versions that load it as a plain merged linear
        pass
    else:
        rules[DeepSeekV2FusedQkvAProjLinear] = _merged_column_parallel
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


@dataclass(frozen=True, slots=True)
class _Part:
    """Where one part of a fused vLLM layer lives in the checkpoint: rows `[offset, offset +
    size)` of `hf_module`, a tensor of `tensor_rows` rows."""

    hf_module: str
    offset: int
    tensor_rows: int


def _fused_parts(ctx: LayerContext, path: str, sizes: Sequence[int]) -> list[_Part]:
    """The checkpoint home of each part of a fused layer, from the packed-modules mapping:
    one checkpoint tensor per part (`qkv_proj` ← q/k/v_proj), or, where the mapping names
    the fused module itself (Phi-3: `qkv_proj` ← `qkv_proj`), one checkpoint tensor holding
    the parts stacked in order, as vLLM's loader splits it (`loaded_shard_id=None`)."""
    local = path.rpartition(".")[2]
    names = ctx.packed.get(local)
    if names is not None and len(names) == len(sizes):
        return [
            _Part(_hf_module(ctx, path, n), 0, int(size))
            for n, size in zip(names, sizes, strict=True)
        ]
    if (names is not None and tuple(names) == (local,)) or (
        names is None and path in ctx.self_fused
    ):
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return [_Part(path, off, sum(sizes)) for off in offsets]
    raise LayoutError(
        f"fused layer {local!r} has {len(sizes)} parts but the packed-modules mapping gives "
        f"{list(names) if names else 'none'}",
        tensor=path,
    )


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
            _blocks(b.offset, block_n, f"{b.hf_module} fused part offset", scale_name),
            _ceil_blocks(b.tensor_rows, block_n),
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
        start = band.offset + band.index * band.rows
        hf_rows = (start, start + band.rows)
        local_rows = (offset, offset + band.rows)
        if cols is None:
            spec = _param_spec(ctx, band.hf_module, pname, (band.total_rows,), dtype)
            placements.append(Placement(spec.name, (hf_rows,), (local_rows,)))
        else:
            spec = _param_spec(ctx, band.hf_module, pname, (band.total_rows, cols), dtype)
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
    head, v_head = int(layer.head_size), int(getattr(layer, "v_head_size", layer.head_size))
    heads, kv_heads = int(layer.num_heads), int(layer.num_kv_heads)
    kv_rank = tp_rank // int(layer.num_kv_head_replicas)
    total_heads, total_kv = int(layer.total_num_heads), int(layer.total_num_kv_heads)
    # (rows per rank, which block of them, the part's checkpoint rows) for q, k, v.
    splits = [
        (heads * head, tp_rank, total_heads * head),
        (kv_heads * head, kv_rank, total_kv * head),
        (kv_heads * v_head, kv_rank, total_kv * v_head),
    ]
    parts = _fused_parts(ctx, path, [total for _, _, total in splits])
    bands = [
        _Band(part.hf_module, rows, index, total, part.offset, part.tensor_rows)
        for part, (rows, index, total) in zip(parts, splits, strict=True)
    ]
    return _column_bands(ctx, path, layer, owned, bands)


def _merged_column_parallel(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    """`MergedColumnParallelLinear.weight_loader`: part i holds rows
    `[tp_rank * n_i / tp, (tp_rank + 1) * n_i / tp)` of checkpoint tensor i, parts stacked."""
    tp_rank, tp_size = _layer_tp(ctx, path, layer)
    sizes = [int(n) for n in layer.output_sizes]
    bands = []
    for part, size in zip(_fused_parts(ctx, path, sizes), sizes, strict=True):
        if size % tp_size:
            raise LayoutError(f"output size {size} is not divisible by TP {tp_size}", tensor=path)
        bands.append(
            _Band(part.hf_module, size // tp_size, tp_rank, size, part.offset, part.tensor_rows)
        )
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


def _row_sharded_vector(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    """A vector split evenly by TP (`sharded_weight_loader(0)`: rank r holds entries
    `[r * n, (r + 1) * n)`), e.g. Mamba2's gated RMSNorm weight."""
    _expect_params(path, owned, ("weight",))
    tp_rank, tp_size = int(layer.tp_rank), int(layer.tp_size)
    param = owned["weight"]
    (n,) = (int(d) for d in param.shape)
    spec = _param_spec(ctx, path, "weight", (n * tp_size,), _dtype(param))
    placement = Placement(spec.name, ((tp_rank * n, (tp_rank + 1) * n),), ((0, n),))
    return [
        DescribedParam(
            ParamLayout(_join(path, "weight"), (n,), _dtype(param), (placement,)), (spec,)
        )
    ]


def _router(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """An MoE router (`GateLinear`): a replicated linear, plus, for DeepSeek-V3-style
    noaux_tc routing, the whole `e_score_correction_bias` vector the model hangs on it."""
    bias_name = "e_score_correction_bias"
    linear = {k: v for k, v in owned.items() if k != bias_name}
    out = _replicated_linear(ctx, path, layer, linear)
    if bias_name in owned:
        param = owned[bias_name]
        out.append(_whole(ctx, path, bias_name, _dtype(param), tuple(param.shape)))
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
    columns of `down_proj`. A non-gated MoE (NemotronH's ReLU² experts) has no gate: its
    `w13_weight[l]` holds only those rows of the one up projection, which the model names as
    the layer's checkpoint "gate" (`ckpt_gate_proj_name`, e.g. `up_proj`). Sizes padded by
    the MoE backend are padding."""
    _expect_params(path, owned, ("w13_weight", "w2_weight"))
    _expect_unquantized(path, layer, owned, "UnquantizedFusedMoEMethod")
    cfg = layer.moe_config
    par = cfg.moe_parallel_config
    param_name = _join(path, "w13_weight")
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
        return _param_spec(ctx, _join(prefix, f"{g}.{ckpt}"), "weight", shape, dtype)

    out = []
    for pname, param in owned.items():
        dtype = _dtype(param)
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
