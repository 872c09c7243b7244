"""Megatron's expert parameters → the Hugging Face boxes they hold: routed experts in every
storage Megatron has (SequentialMLP, TEGroupedMLP, Transformer Engine's single grouped
weight, the legacy GroupedMLP's `weight1` / `weight2`) and the shared experts.

Expert parameters are sliced by the *expert* tensor-parallel rank and numbered by the
expert-parallel rank, which may form a differently shaped mesh over the same ranks; shared
experts are one MLP on the dense tensor-parallel group.
"""

from __future__ import annotations

import torch

from refitplane.trainer.layouts.held import HeldSlice
from refitplane.trainer.layouts.megatron_slicing import (
    GluBlocks,
    MegatronParam,
    col_slice,
    gate_up_slices,
    whole_slice,
)


def _experts_per_rank(p: MegatronParam) -> int:
    experts, ep = p.dims.num_experts, p.par.ep_size
    if experts == 0 or experts % ep:
        raise p.error(
            f"is an expert, but {experts} experts do not split over {ep} expert-parallel ranks",
            field="parallel",
        )
    return experts // ep


def _global_expert(p: MegatronParam, local_index: int) -> int:
    per_rank = _experts_per_rank(p)
    if not 0 <= local_index < per_rank:
        raise p.error(f"names local expert {local_index}, but each rank holds {per_rank}")
    return p.par.ep_rank * per_rank + local_index


def expert_blocks(p: MegatronParam, fc: int, storage: str | None) -> GluBlocks | None:
    """The routed experts' GLU blocks for fc1 of a storage whose forward reads them.

    Only TEGroupedMLP de-interleaves (`storage` None). SequentialMLP and the legacy
    GroupedMLP compute `[gate; up]`, so with the setting on, what their memory holds
    depends on who loaded it: refused rather than guessed.
    """
    k = p.glu.experts
    if fc != 1 or k is None:
        return None
    if storage is not None:
        raise p.error(
            f"is a {storage} fc1, whose forward reads [gate; up], but the model sets "
            f"moe_mlp_glu_interleave_size={k}; which layout its memory holds is unknown",
            field="moe_mlp_glu_interleave_size",
        )
    return (k, "moe_mlp_glu_interleave_size")


def expert_fc(
    p: MegatronParam,
    layer: str,
    local_index: int,
    fc: int,
    t: torch.Tensor,
    blocks: GluBlocks | None = None,
) -> list[HeldSlice]:
    d, par = p.dims, p.par
    ffn = d.expert_ffn(tensor=p.name)
    prefix = f"{layer}mlp.experts.{_global_expert(p, local_index)}."
    if t.dim() != 2:
        raise p.error(f"is {t.dim()}-d, an expert weight is 2-d")
    if fc == 1:
        if t.shape[1] != d.hidden_size:
            raise p.error(f"has {t.shape[1]} input features, expected {d.hidden_size}")
        return gate_up_slices(p, t, prefix, "weight", ffn, par.etp_rank, par.etp_size, blocks)
    if t.shape[0] != d.hidden_size:
        raise p.error(f"has {t.shape[0]} output features, expected {d.hidden_size}")
    return [col_slice(p, t, f"{prefix}down_proj.weight", ffn, par.etp_rank, par.etp_size)]


def grouped_experts(p: MegatronParam, layer: str, fc: int) -> list[HeldSlice]:
    """GroupedMLP's `weight1` / `weight2`, read the way Megatron's forward reads them."""
    d, par, t = p.dims, p.par, p.tensor
    expert_blocks(p, fc, "legacy GroupedMLP")
    per_rank = d.num_experts // par.ep_size if d.num_experts % par.ep_size == 0 else 0
    if per_rank == 0 or t.dim() != 2 or t.numel() % (per_rank * d.hidden_size):
        raise p.error(
            f"has shape {list(t.shape)}, not {per_rank or '?'} experts of width {d.hidden_size}"
        )
    try:
        experts = (
            t.view(per_rank, d.hidden_size, -1) if fc == 1 else t.view(per_rank, -1, d.hidden_size)
        )
    except RuntimeError as exc:  # only a non-contiguous parameter cannot be viewed
        raise p.error(f"cannot be viewed per expert: {exc}") from exc
    out: list[HeldSlice] = []
    for i in range(per_rank):
        out += expert_fc(p, layer, i, fc, experts[i].t())
    return out


def _grouped_tensor_data(p: MegatronParam) -> torch.Tensor:
    """The plain tensor behind a Transformer Engine `GroupedTensor` parameter (else `t`).

    With `moe_single_grouped_weight` TE's GroupedLinear registers one `weight` that is a
    `GroupedTensor` wrapper subclass of shape `[n, out, in]`
    (transformer_engine/pytorch/tensor/grouped_tensor.py). It refuses slicing, but answers
    `view(-1)` with its backing `rowwise_data` (the path Megatron's distributed optimizer
    flattens it by), so the experts are views of that buffer. With FP8/FP4 primary
    weights (`quantizer` set) the buffer holds quantized bytes, not the checkpoint's values.
    """
    t = p.tensor
    if not hasattr(t, "rowwise_data"):
        return t
    if getattr(t, "quantizer", None) is not None:
        raise p.error(
            "is a quantized Transformer Engine GroupedTensor (moe_single_grouped_weight with "
            "FP8/FP4 primary weights); its storage holds quantized data, not the weights",
            field="moe_single_grouped_weight",
        )
    shape = tuple(t.shape)
    flat = t.view(-1)
    if hasattr(flat, "rowwise_data") or flat.numel() != t.numel():
        raise p.error(
            "is a GroupedTensor whose view(-1) is not its plain backing buffer",
            field="moe_single_grouped_weight",
        )
    return flat.view(shape)


def single_grouped_experts(p: MegatronParam, layer: str, fc: int) -> list[HeldSlice]:
    """TE GroupedLinear's single grouped `weight`: every local expert's weight, stacked.

    TE stacks the per-GEMM weights on a new first dimension
    (GroupedLinear._remap_grouped_weight_state_dict_keys: `torch.stack(weight0..N)`), so
    expert `i` is `weight[i]`; the `[n*out, in]` logical form is read as `view(n, out, in)`.
    """
    per_rank = _experts_per_rank(p)
    t = _grouped_tensor_data(p)
    if t.dim() == 2 and t.shape[0] % per_rank == 0:
        try:
            t = t.view(per_rank, -1, t.shape[1])
        except RuntimeError as exc:
            raise p.error(f"cannot be viewed per expert: {exc}") from exc
    if t.dim() != 3 or t.shape[0] != per_rank:
        raise p.error(
            f"has shape {list(p.tensor.shape)}, not [{per_rank}, out, in] or "
            f"[{per_rank}*out, in] for {per_rank} local experts"
        )
    blocks = expert_blocks(p, fc, None)
    out: list[HeldSlice] = []
    for i in range(per_rank):
        out += expert_fc(p, layer, i, fc, t[i], blocks)
    return out


def shared_fc1(p: MegatronParam, layer: str) -> list[HeldSlice]:
    """Shared experts are one MLP on the dense tensor-parallel group (SharedExpertMLP)."""
    d = p.dims
    ffn = d.shared_ffn(tensor=p.name)
    t = p.tensor
    if t.dim() != 2 or t.shape[1] != d.hidden_size:
        raise p.error(f"has shape {list(t.shape)}, expected [2*shared_ffn/tp, {d.hidden_size}]")
    k = p.glu.shared_experts
    blocks = None if k is None else (k, "moe_shared_expert_glu_interleave_size")
    prefix = layer + d.shared_expert_prefix
    return gate_up_slices(p, t, prefix, "weight", ffn, p.par.tp_rank, p.par.tp_size, blocks)


def shared_fc2(p: MegatronParam, layer: str) -> list[HeldSlice]:
    d, t = p.dims, p.tensor
    ffn = d.shared_ffn(tensor=p.name)
    if t.dim() != 2 or t.shape[0] != d.hidden_size:
        raise p.error(f"has shape {list(t.shape)}, expected [{d.hidden_size}, shared_ffn/tp]")
    name = f"{layer}{d.shared_expert_prefix}down_proj.weight"
    return [col_slice(p, t, name, ffn, p.par.tp_rank, p.par.tp_size)]


def shared_gate(p: MegatronParam, layer: str) -> list[HeldSlice]:
    """`shared_experts.gate_weight` [1, hidden]: Qwen2-MoE's `shared_expert_gate`."""
    d = p.dims
    d.shared_ffn(tensor=p.name)
    if d.shared_expert_prefix != "mlp.shared_expert.":
        raise p.error(
            "is a shared-expert gate, which a checkpoint naming its experts "
            f"{d.shared_expert_prefix!r} (DeepSeek) does not have",
            field="name",
        )
    return whole_slice(p, f"{layer}mlp.shared_expert_gate.weight", (1, d.hidden_size))
