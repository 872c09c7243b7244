"""What every layer rule (`vllm_layer_rules`) is made of: the context it reads
(`LayerContext`), what it answers (`DescribedParam`: a parameter's layout and the checkpoint
tensors it places), and the checks and pieces the rules share: a layer's own TP coordinates,
parameters it may have, checkpoint names of its siblings, a whole parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import ParamLayout, Placement, VllmRanks
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


Owned = Mapping[str, torch.nn.Parameter]


Rule = Callable[[LayerContext, str, Any, Owned], list[DescribedParam]]


def join_name(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def dtype_of(param: torch.Tensor) -> str:
    return dtype_name(param.dtype)


def expect_params(path: str, owned: Owned, allowed: Sequence[str]) -> None:
    extra = sorted(set(owned) - set(allowed))
    if extra:
        raise LayoutError(
            f"unexpected parameter on a {', '.join(allowed)} layer; only {list(allowed)} "
            "are understood",
            tensor=join_name(path, extra[0]),
        )


def expect_unquantized(path: str, layer: Any, owned: Owned, method: str) -> None:
    quant = type(getattr(layer, "quant_method", None)).__name__
    if quant != method:
        raise LayoutError(
            f"layer uses quant method {quant}; the direct layout covers unquantized "
            "weights only (quantized weights go through vLLM's layerwise reload)",
            tensor=join_name(path, sorted(owned)[0]),
        )


def layer_tp(ctx: LayerContext, path: str, layer: Any) -> tuple[int, int]:
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


def sibling_module(ctx: LayerContext, path: str, name: str) -> str:
    """The checkpoint module name of sibling `name` of the vLLM module at `path`."""
    parent = path.rpartition(".")[0]
    return join_name(parent, name)


def param_spec(
    ctx: LayerContext, hf_module: str, pname: str, shape: Sequence[int], dtype: str
) -> TensorSpec:
    return TensorSpec.create(ctx.to_hf_name(join_name(hf_module, pname)), list(shape), dtype)


def whole_param(
    ctx: LayerContext, path: str, pname: str, dtype: str, shape: tuple[int, ...]
) -> DescribedParam:
    spec = param_spec(ctx, path, pname, shape, dtype)
    placement = Placement(spec.name, whole_box(shape), whole_box(shape))
    return DescribedParam(ParamLayout(join_name(path, pname), shape, dtype, (placement,)), (spec,))
