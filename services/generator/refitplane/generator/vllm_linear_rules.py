"""Rules of vLLM's linear layers (`model_executor/layers/linear.py`): QKV, merged
column-parallel (gate/up, fused parts stored fused or apart), column- and row-parallel and
replicated layers, unquantized or FP8 with block scales, whose `weight_scale_inv` rows and
columns split like the weight, in block units (`adjust_block_scale_shard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import ParamLayout, Placement
from refitplane.generator.vllm_rule_parts import (
    DescribedParam,
    dtype_of,
    expect_params,
    join_name,
    layer_tp,
    param_spec,
    sibling_module,
    whole_param,
)
from refitplane.reshard.layout import TensorSpec

if TYPE_CHECKING:
    from refitplane.generator.vllm_rule_parts import LayerContext, Owned


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


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How a linear layer's checkpoint stores its weight: as the live parameter's dtype
    (`block` None) or as FP8 with one `scale_dtype` scale per `block` (rows, cols)."""

    block: tuple[int, int] | None = None
    scale_dtype: str = "float32"


FP8_WEIGHT_DTYPE = "float8_e4m3fn"


BLOCK_SCALE_NAME = "weight_scale_inv"


def fp8_block_format(method: Any) -> WeightFormat | None:
    """The block format of an FP8 quant method (`weight_block_size` [block_n, block_k],
    float32 scales unless the method keeps them as E8M0); None without block scales."""
    block = getattr(method, "weight_block_size", None)
    if block is None or len(block) != 2:
        return None
    scale = "float8_e8m0fnu" if getattr(method, "is_scale_e8m0", False) else "float32"
    return WeightFormat((int(block[0]), int(block[1])), scale)


def _linear_format(path: str, layer: Any, owned: Owned) -> WeightFormat:
    method = getattr(layer, "quant_method", None)
    kind = type(method).__name__
    if kind == "UnquantizedLinearMethod":
        expect_params(path, owned, ("weight", "bias"))
        return WeightFormat()
    fmt = fp8_block_format(method)
    if kind == "Fp8LinearMethod" and fmt is not None:
        return fmt
    raise LayoutError(
        f"layer uses quant method {kind}"
        + (" without block scales" if kind == "Fp8LinearMethod" else "")
        + "; linear layers must be unquantized or FP8 with block scales (weight_block_size)",
        tensor=join_name(path, sorted(owned)[0] if owned else "weight"),
    )


def whole_blocks(size: int, block: int, what: str, tensor: str) -> int:
    """`size` in units of `block`; a shard must start and end on a block boundary."""
    if size % block:
        raise LayoutError(
            f"{what} {size} is not a multiple of the FP8 block size {block}", tensor=tensor
        )
    return size // block


def ceil_blocks(size: int, block: int) -> int:
    return -(-size // block)


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
            _Part(sibling_module(ctx, path, n), 0, int(size))
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
                tensor=join_name(path, "weight"),
            )
    out: list[DescribedParam] = []
    if "bias" in owned:
        out.append(_stacked(ctx, path, "bias", dtype_of(owned["bias"]), bands, None))
    if fmt.block is None:
        out.append(_stacked(ctx, path, "weight", dtype_of(owned["weight"]), bands, cols))
        return out
    block_n, block_k = fmt.block
    out.append(_stacked(ctx, path, "weight", FP8_WEIGHT_DTYPE, bands, cols))
    scale_name = join_name(path, BLOCK_SCALE_NAME)
    scale_bands = [
        _Band(
            b.hf_module,
            whole_blocks(b.rows, block_n, f"{b.hf_module} shard of rows", scale_name),
            b.index,
            ceil_blocks(b.hf_rows, block_n),
            whole_blocks(b.offset, block_n, f"{b.hf_module} fused part offset", scale_name),
            ceil_blocks(b.tensor_rows, block_n),
        )
        for b in bands
    ]
    # A column-parallel layer reads its whole input: the scale's columns are not split.
    scale_cols = ceil_blocks(cols, block_k)
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
            spec = param_spec(ctx, band.hf_module, pname, (band.total_rows,), dtype)
            placements.append(Placement(spec.name, (hf_rows,), (local_rows,)))
        else:
            spec = param_spec(ctx, band.hf_module, pname, (band.total_rows, cols), dtype)
            placements.append(Placement(spec.name, (hf_rows, (0, cols)), (local_rows, (0, cols))))
        specs.append(spec)
        offset += band.rows
    shape = (offset,) if cols is None else (offset, cols)
    return DescribedParam(
        ParamLayout(join_name(path, pname), shape, dtype, tuple(placements)), tuple(specs)
    )


def qkv_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`QKVParallelLinear.weight_loader`: rows `[q | k | v]`; q heads split by TP; when TP >
    the number of KV heads each rank holds one KV head, `tp_rank // num_kv_head_replicas`."""
    tp_rank, _ = layer_tp(ctx, path, layer)
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


def merged_column_parallel(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    """`MergedColumnParallelLinear.weight_loader`: part i holds rows
    `[tp_rank * n_i / tp, (tp_rank + 1) * n_i / tp)` of checkpoint tensor i, parts stacked."""
    tp_rank, tp_size = layer_tp(ctx, path, layer)
    sizes = [int(n) for n in layer.output_sizes]
    bands = []
    for part, size in zip(_fused_parts(ctx, path, sizes), sizes, strict=True):
        if size % tp_size:
            raise LayoutError(f"output size {size} is not divisible by TP {tp_size}", tensor=path)
        bands.append(
            _Band(part.hf_module, size // tp_size, tp_rank, size, part.offset, part.tensor_rows)
        )
    return _column_bands(ctx, path, layer, owned, bands)


def column_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    tp_rank, _ = layer_tp(ctx, path, layer)
    rows = int(layer.output_size_per_partition)
    return _column_bands(
        ctx, path, layer, owned, [_Band(path, rows, tp_rank, int(layer.output_size))]
    )


def row_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`RowParallelLinear.weight_loader`: weight columns split by TP; the bias is whole. FP8
    block scales split their columns the same way, in block units."""
    fmt = _linear_format(path, layer, owned)
    tp_rank, _ = layer_tp(ctx, path, layer)
    rows, cols = int(layer.output_size_per_partition), int(layer.input_size_per_partition)
    out = []
    if "bias" in owned:
        out.append(whole_param(ctx, path, "bias", dtype_of(owned["bias"]), (rows,)))
    weight_dtype = dtype_of(owned["weight"]) if fmt.block is None else FP8_WEIGHT_DTYPE
    out.append(
        _column_slice(
            ctx, path, "weight", weight_dtype, rows, (cols, int(layer.input_size)), tp_rank
        )
    )
    if fmt.block is not None:
        block_n, block_k = fmt.block
        scale_name = join_name(path, BLOCK_SCALE_NAME)
        scale_rows = ceil_blocks(rows, block_n)
        local_cols = whole_blocks(cols, block_k, "input columns per rank", scale_name)
        hf_cols = ceil_blocks(int(layer.input_size), block_k)
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
    spec = param_spec(ctx, path, pname, (rows, hf_cols), dtype)
    hf_box = ((0, rows), (tp_rank * local_cols, (tp_rank + 1) * local_cols))
    placement = Placement(spec.name, hf_box, ((0, rows), (0, local_cols)))
    return DescribedParam(
        ParamLayout(join_name(path, pname), (rows, local_cols), dtype, (placement,)), (spec,)
    )


def replicated_linear(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    fmt = _linear_format(path, layer, owned)
    if path.rpartition(".")[2] in ctx.packed:
        raise LayoutError("fused replicated linear layers are not supported", tensor=path)
    rows, cols = int(layer.output_size), int(layer.input_size)
    out = []
    if "bias" in owned:
        out.append(whole_param(ctx, path, "bias", dtype_of(owned["bias"]), (rows,)))
    if fmt.block is None:
        out.append(whole_param(ctx, path, "weight", dtype_of(owned["weight"]), (rows, cols)))
    else:
        block_n, block_k = fmt.block
        out.append(whole_param(ctx, path, "weight", FP8_WEIGHT_DTYPE, (rows, cols)))
        scale_shape = (ceil_blocks(rows, block_n), ceil_blocks(cols, block_k))
        out.append(whole_param(ctx, path, BLOCK_SCALE_NAME, fmt.scale_dtype, scale_shape))
    return out
