"""Synthetic Megatron shards for the layout rules' unit tests (`test_megatron_mla_experts.py`,
`test_megatron_refusals.py`): DeepSeek-style dimensions with multi-latent attention (`MLA`,
`LITE` without query LoRA) and a GQA model beside them, the rules' slices of one local
tensor (`slices`, which test_megatron_params.py uses with its own dimensions), and the check that every rank's slices together rebuild the truth
(`check_union`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from refitplane.reshard.boxes import to_slices
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.held import HeldSlice, register
from refitplane.trainer.layouts.megatron_params import megatron_param_slices
from refitplane.trainer.layouts.megatron_slicing import GluInterleave, MegatronParallel

H, HEADS, QL, KVL, NOPE, ROPE, V = 16, 4, 12, 8, 6, 4, 6
E, F, SHARED = 4, 8, 12
MLA = ModelDims(
    hidden_size=H,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    head_dim=ROPE,  # transformers' DeepSeek-V3 config says head_dim = qk_rope_head_dim
    vocab_size=10,
    intermediate_size=20,
    moe_intermediate_size=F,
    num_experts=E,
    q_lora_rank=QL,
    kv_lora_rank=KVL,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=V,
    shared_expert_intermediate_size=SHARED,
    first_k_dense_replace=1,
)
LITE = replace(MLA, q_lora_rank=None)
GQA = ModelDims(
    hidden_size=H,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    vocab_size=10,
    moe_intermediate_size=F,
    num_experts=E,
)
L = "model.layers.5."
R2 = MegatronParallel(rank=2)
R2_OF_TP2 = MegatronParallel(rank=2, tp_rank=1, tp_size=2)
A = L + "self_attn."


def slices(
    name: str,
    tensor: torch.Tensor,
    par: MegatronParallel,
    *,
    dims: ModelDims = MLA,
    glu: GluInterleave | None = None,
    layer: int = 5,
    layers: dict[int, int] | None = None,
    tied: bool = False,
) -> list[HeldSlice]:
    """The rules' slices of `tensor`, Megatron's `name` on rank `par`: its local layer 0 is
    the model's `layer` (or `layers` maps each local layer to the model's); `tied`: the
    output layer shares the embedding."""
    return megatron_param_slices(
        name,
        tensor,
        dims=dims,
        parallel=par,
        layer_numbers={0: layer} if layers is None else layers,
        tied_output=tied,
        glu_interleave=glu,
    )


def tp(rank: int, size: int, **kw: Any) -> MegatronParallel:
    return MegatronParallel(rank=rank, tp_rank=rank, tp_size=size, **kw)


def check_union(
    name: str,
    truth: dict[str, torch.Tensor],
    locals_: list[tuple[torch.Tensor, MegatronParallel]],
    *,
    copies: int = 1,
    **kw: Any,
) -> list[list[HeldSlice]]:
    """Every rank's boxes hold exactly the truth's values, as views of its local tensor,
    and together cover every element `copies` times (1: split, n: replicated)."""
    counts = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in truth.items()}
    out = []
    for local, par in locals_:
        held = slices(name, local, par, **kw)
        register(held, rank=par.rank)  # the registry accepts them (no overlaps, shapes fit)
        for s in held:
            assert s.shape == tuple(truth[s.name].shape), s.name
            assert torch.equal(s.view, truth[s.name][to_slices(s.box)]), (s.name, s.box)
            assert s.view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            counts[s.name][to_slices(s.box)] += 1
        out.append(held)
    for n, c in counts.items():
        assert bool((c == copies).all()), (n, c)
    return out
