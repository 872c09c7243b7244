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
(`linear.py: adjust_block_scale_shard`). FP8 linear kernels rewrite both after loading,
so those layers are received into checkpoint-format staging and loaded through vLLM's
layerwise reload (`vllm_live`); the description is in loader format, built from the layer's
sizes rather than from the processed live parameters. Routed experts are unquantized or
block-FP8 too (`Fp8MoEMethod`: `w13_weight_scale_inv` / `w2_weight_scale_inv` in block
units, `vllm_expert_rules`), described the same way; whether they can be received in place
depends on the MoE backend's processing (vLLM 0.26's TRITON backend keeps them as loaded),
which the receive side decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from refitplane.errors import LayoutError
from refitplane.generator.vllm_expert_rules import routed_experts, router
from refitplane.generator.vllm_layout import PaddingRegion, ParamLayout, Placement
from refitplane.generator.vllm_linear_rules import (
    column_parallel,
    merged_column_parallel,
    qkv_parallel,
    replicated_linear,
    row_parallel,
)
from refitplane.generator.vllm_rule_parts import (
    DescribedParam,
    dtype_of,
    expect_params,
    expect_unquantized,
    join_name,
    layer_tp,
    param_spec,
    whole_param,
)
from refitplane.reshard.shards import dtype_name

if TYPE_CHECKING:
    from refitplane.generator.vllm_rule_parts import LayerContext, Owned, Rule


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
            tensor=join_name(path, sorted(owned)[0]),
        )
    for pname, param in owned.items():
        for flag in _LOADER_FLAGS:
            if getattr(param, flag, None) not in (None, False):
                raise LayoutError(
                    f"parameter has loader attribute {flag}={getattr(param, flag)!r}; "
                    "pre-sharded, packed or transposed parameters are not supported",
                    tensor=join_name(path, pname),
                )
        loader = getattr(loader_template(module, pname, param), "weight_loader", None)
        if loader is not None and not _standard_loader(module, loader, type(module).__name__):
            raise LayoutError(
                f"parameter has its own weight loader "
                f"({getattr(loader, '__qualname__', type(loader).__name__)}), not its layer's; "
                "what it does is not described by the layer's rule",
                tensor=join_name(path, pname),
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
        linear.QKVParallelLinear: qkv_parallel,
        linear.MergedColumnParallelLinear: merged_column_parallel,
        linear.ColumnParallelLinear: column_parallel,
        linear.RowParallelLinear: row_parallel,
        linear.ReplicatedLinear: replicated_linear,
        vocab.VocabParallelEmbedding: _vocab_parallel,
        vocab.ParallelLMHead: _vocab_parallel,
        RoutedExperts: routed_experts,
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
        rules[GateLinear] = router
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
        rules[DeepSeekV2FusedQkvAProjLinear] = merged_column_parallel
    return rules


# --- helpers -------------------------------------------------------------------------------


# --- rules -----------------------------------------------------------------------------------


def _row_sharded_vector(
    ctx: LayerContext, path: str, layer: Any, owned: Owned
) -> list[DescribedParam]:
    """A vector split evenly by TP (`sharded_weight_loader(0)`: rank r holds entries
    `[r * n, (r + 1) * n)`), e.g. Mamba2's gated RMSNorm weight."""
    expect_params(path, owned, ("weight",))
    tp_rank, tp_size = int(layer.tp_rank), int(layer.tp_size)
    param = owned["weight"]
    (n,) = (int(d) for d in param.shape)
    spec = param_spec(ctx, path, "weight", (n * tp_size,), dtype_of(param))
    placement = Placement(spec.name, ((tp_rank * n, (tp_rank + 1) * n),), ((0, n),))
    return [
        DescribedParam(
            ParamLayout(join_name(path, "weight"), (n,), dtype_of(param), (placement,)), (spec,)
        )
    ]


def _replicated(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """Norms: every rank holds the whole tensor (the live shape is the loader's shape)."""
    expect_params(path, owned, ("weight", "bias"))
    return [
        whole_param(ctx, path, pname, dtype_of(param), tuple(param.shape))
        for pname, param in owned.items()
    ]


def _vocab_parallel(ctx: LayerContext, path: str, layer: Any, owned: Owned) -> list[DescribedParam]:
    """`VocabParallelEmbedding.weight_loader`: this rank's rows of the real vocabulary first,
    then padding rows (the vocabulary is padded to a multiple of 64, then split by TP)."""
    expect_params(path, owned, ("weight",))
    expect_unquantized(path, layer, owned, "UnquantizedEmbeddingMethod")
    layer_tp(ctx, path, layer)
    indices = layer.shard_indices
    if int(indices.added_vocab_end_index) > int(indices.added_vocab_start_index):
        raise LayoutError(
            "added (LoRA) vocabulary rows are not supported", tensor=join_name(path, "weight")
        )
    param = owned["weight"]
    dtype = dtype_of(param)
    dim = int(layer.embedding_dim)
    local_rows = int(layer.num_embeddings_per_partition)
    start, stop = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
    real = stop - start
    spec = param_spec(ctx, path, "weight", (int(layer.org_vocab_size), dim), dtype)
    placements = (
        (Placement(spec.name, ((start, stop), (0, dim)), ((0, real), (0, dim))),) if real else ()
    )
    padding = (
        (PaddingRegion(((real, local_rows), (0, dim)), "vocabulary padding"),)
        if local_rows > real
        else ()
    )
    name = join_name(path, "weight")
    return [
        DescribedParam(ParamLayout(name, (local_rows, dim), dtype, placements, padding), (spec,))
    ]
