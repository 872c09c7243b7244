"""Megatron rules for DeepSeek-style models on synthetic shards laid out as Megatron lays
them out: multi-latent attention (both specs), shared experts, the router's expert bias,
TE's single grouped expert weight (also as a GroupedTensor look-alike) and GLU-interleaved
fc1 (the shards and their checks: `megatron_synthetic`; every refusal:
test_megatron_refusals.py). Real CPU-built MLA models are in the integration tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import to_slices
from refitplane.trainer.layouts.held import register
from refitplane.trainer.layouts.megatron_slicing import GluInterleave, MegatronParallel
from tests.unit.trainer.layouts.megatron_synthetic import (
    GQA,
    HEADS,
    KVL,
    LITE,
    NOPE,
    QL,
    ROPE,
    SHARED,
    A,
    E,
    F,
    H,
    L,
    V,
    check_union,
    slices,
    tp,
)

pytestmark = pytest.mark.unit

# ---- multi-latent attention ----------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
def test_mla_up_projections_are_column_parallel_over_heads(size: int) -> None:
    """Megatron's ColumnParallelLinear gives rank r output rows [r*n/tp, (r+1)*n/tp); the
    output is per head [nope; rope] (q) or [nope; v] (kv), as in the checkpoint."""
    for mname, hname, rows, cols in (
        ("linear_q_up_proj", "q_b_proj", HEADS * (NOPE + ROPE), QL),
        ("linear_kv_up_proj", "kv_b_proj", HEADS * (NOPE + V), KVL),
    ):
        truth = {f"{A}{hname}.weight": torch.randn(rows, cols)}
        full = truth[f"{A}{hname}.weight"]
        locals_ = [(full.chunk(size)[r].clone(), tp(r, size)) for r in range(size)]
        check_union(f"decoder.layers.0.self_attention.{mname}.weight", truth, locals_)


@pytest.mark.parametrize("size", [1, 2])
def test_mla_down_projections_split_in_the_local_spec_and_replicated_in_transformer_engine(
    size: int,
) -> None:
    """Local spec: ColumnParallelLinear (rows split). TE spec: TELinear with
    parallel_mode="duplicated" (every rank holds all rows)."""
    for mname, hname, rows in (
        ("linear_q_down_proj", "q_a_proj", QL),
        ("linear_kv_down_proj", "kv_a_proj_with_mqa", KVL + ROPE),
    ):
        name = f"decoder.layers.0.self_attention.{mname}.weight"
        full = torch.randn(rows, H)
        truth = {f"{A}{hname}.weight": full}
        split = [(full.chunk(size)[r].clone(), tp(r, size)) for r in range(size)]
        check_union(name, truth, split)
        replicated = [(full.clone(), tp(r, size)) for r in range(size)]
        check_union(name, truth, replicated, copies=size)


def test_mla_norms_local_and_transformer_engine_names() -> None:
    par = tp(1, 2)
    for megatron, hf, n in (
        ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", QL),
        ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attn.q_a_layernorm.weight", QL),
        ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight", KVL),
        (
            "self_attention.linear_kv_up_proj.layer_norm_weight",
            "self_attn.kv_a_layernorm.weight",
            KVL,
        ),
        ("self_attention.linear_q_proj.layer_norm_weight", "input_layernorm.weight", H),
    ):
        held = slices(f"decoder.layers.0.{megatron}", torch.randn(n), par)
        assert [(s.name, s.box) for s in held] == [(L + hf, ((0, n),))]


def test_q_layernorm_stays_the_per_head_q_norm_for_gqa_checkpoints() -> None:
    held = slices(
        "decoder.layers.0.self_attention.q_layernorm.weight", torch.ones(4), tp(0, 1), dims=GQA
    )
    assert held[0].name == A + "q_norm.weight"


@pytest.mark.parametrize("size", [1, 2])
def test_mla_without_query_lora_has_one_column_parallel_q_proj(size: int) -> None:
    full = torch.randn(HEADS * (NOPE + ROPE), H)
    truth = {A + "q_proj.weight": full}
    locals_ = [(full.chunk(size)[r].clone(), tp(r, size)) for r in range(size)]
    check_union("decoder.layers.0.self_attention.linear_q_proj.weight", truth, locals_, dims=LITE)


def test_mla_output_projection_columns_are_heads_times_v_head_dim() -> None:
    o = torch.randn(H, HEADS * V)
    locals_ = [(o.chunk(2, dim=1)[r].clone(), tp(r, 2)) for r in range(2)]
    check_union(
        "decoder.layers.0.self_attention.linear_proj.weight", {A + "o_proj.weight": o}, locals_
    )


# ---- shared experts and router bias --------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2])
def test_shared_experts_are_a_dense_tp_mlp(size: int) -> None:
    """SharedExpertMLP is an MLP on the dense TP group: fc1 [gate_r; up_r], fc2 columns."""
    p = L + "mlp.shared_experts."
    gate, up, down = torch.randn(SHARED, H), torch.randn(SHARED, H), torch.randn(H, SHARED)
    fc1 = [
        (torch.cat([gate.chunk(size)[r], up.chunk(size)[r]]).clone(), tp(r, size))
        for r in range(size)
    ]
    truth = {p + "gate_proj.weight": gate, p + "up_proj.weight": up}
    check_union("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", truth, fc1)
    fc2 = [(down.chunk(size, dim=1)[r].clone(), tp(r, size)) for r in range(size)]
    check_union(
        "decoder.layers.0.mlp.shared_experts.linear_fc2.weight", {p + "down_proj.weight": down}, fc2
    )


def test_qwen2_moe_names_its_shared_expert_and_gate_differently() -> None:
    dims = replace(
        GQA, shared_expert_intermediate_size=SHARED, shared_expert_prefix="mlp.shared_expert."
    )
    par = tp(0, 1)
    fc2 = slices(
        "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
        torch.randn(H, SHARED),
        par,
        dims=dims,
    )
    assert fc2[0].name == L + "mlp.shared_expert.down_proj.weight"
    gate = slices(
        "decoder.layers.0.mlp.shared_experts.gate_weight", torch.randn(1, H), par, dims=dims
    )
    assert [(s.name, s.box) for s in gate] == [
        (L + "mlp.shared_expert_gate.weight", ((0, 1), (0, H)))
    ]


def test_router_expert_bias_is_the_gate_correction_bias() -> None:
    bias = torch.randn(E, dtype=torch.float32)
    held = slices(
        "decoder.layers.0.mlp.router.expert_bias",
        bias,
        MegatronParallel(rank=3, ep_rank=1, ep_size=2),
    )
    assert [(s.name, s.shape, s.box) for s in held] == [
        (L + "mlp.gate.e_score_correction_bias", (E,), ((0, E),))
    ]
    assert held[0].view.dtype == torch.float32


# ---- TE single grouped expert weight -------------------------------------------------------


def expert_truth(experts: range) -> dict[str, torch.Tensor]:
    truth: dict[str, torch.Tensor] = {}
    for e in experts:
        p = f"{L}mlp.experts.{e}."
        truth |= {
            p + "gate_proj.weight": torch.randn(F, H),
            p + "up_proj.weight": torch.randn(F, H),
            p + "down_proj.weight": torch.randn(H, F),
        }
    return truth


def local_fc1(truth: dict[str, torch.Tensor], e: int, etp: int, r: int) -> torch.Tensor:
    p = f"{L}mlp.experts.{e}."
    g, u = truth[p + "gate_proj.weight"], truth[p + "up_proj.weight"]
    return torch.cat([g.chunk(etp)[r], u.chunk(etp)[r]])


def local_fc2(truth: dict[str, torch.Tensor], e: int, etp: int, r: int) -> torch.Tensor:
    return truth[f"{L}mlp.experts.{e}.down_proj.weight"].chunk(etp, dim=1)[r]


def bridge_interleave(t: torch.Tensor, k: int) -> torch.Tensor:
    """Megatron-Bridge's `_interleave_glu_tensor` (training/checkpointing.py), applied to
    each rank's [gate; up]: [g0:k, u0:k, gk:2k, uk:2k, ...]."""
    x = t.reshape(2, t.shape[0] // (2 * k), k, *t.shape[1:])
    return x.transpose(0, 1).contiguous().reshape(t.shape)


class FakeGroupedTensor(torch.Tensor):
    """What the adapter relies on in Transformer Engine's GroupedTensor
    (transformer_engine/pytorch/tensor/grouped_tensor.py): a wrapper subclass of shape
    [n, out, in] over a flat `rowwise_data`; detach keeps the metadata, `view(-1)` returns
    the backing buffer, every other op (slicing included) is refused."""

    rowwise_data: torch.Tensor
    quantizer: object

    @staticmethod
    def __new__(cls, data: torch.Tensor, quantizer: object = None) -> FakeGroupedTensor:
        inst = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=data.device
        )
        inst.rowwise_data = data.reshape(-1)
        inst.quantizer = quantizer
        return inst

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        src = args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return FakeGroupedTensor(src.rowwise_data.view(src.shape), src.quantizer)
        if func is torch.ops.aten.view.default and tuple(args[1]) in ((-1,), (src.numel(),)):
            return src.rowwise_data.view(-1)
        raise RuntimeError(f"GroupedTensor forbids {func}")


@pytest.mark.parametrize("form", ["3d", "2d", "grouped_tensor"])
def test_single_grouped_weight_is_every_local_expert_stacked(form: str) -> None:
    """TE stacks weight0..weightN on a new first dimension (GroupedLinear
    _remap_grouped_weight_state_dict_keys); EP2 x expert-TP2 here."""
    truth = expert_truth(range(E))
    per_rank = E // 2
    for ep_rank in range(2):
        for etp_rank in range(2):
            par = MegatronParallel(
                rank=2 * ep_rank + etp_rank,
                ep_rank=ep_rank,
                ep_size=2,
                etp_rank=etp_rank,
                etp_size=2,
            )
            experts = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
            for fc, build in ((1, local_fc1), (2, local_fc2)):
                stacked = torch.stack([build(truth, e, 2, etp_rank) for e in experts])
                tensor: torch.Tensor = stacked
                if form == "2d":
                    tensor = stacked.reshape(-1, stacked.shape[-1])
                elif form == "grouped_tensor":
                    tensor = FakeGroupedTensor(stacked).detach()
                held = slices(f"decoder.layers.0.mlp.experts.linear_fc{fc}.weight", tensor, par)
                assert len(held) == per_rank * (2 if fc == 1 else 1)
                for s in held:
                    assert torch.equal(s.view, truth[s.name][to_slices(s.box)])
                    assert (
                        s.view.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
                    )
                    assert s.box[0 if fc == 1 else 1] == (
                        etp_rank * F // 2,
                        (etp_rank + 1) * F // 2,
                    )


def test_quantized_grouped_tensor_is_refused() -> None:
    tensor = FakeGroupedTensor(torch.zeros(E, 2 * F, H), quantizer=object())
    with pytest.raises(LayoutError, match="quantized") as err:
        slices("decoder.layers.0.mlp.experts.linear_fc1.weight", tensor, tp(2, 4))
    assert (err.value.tensor, err.value.rank, err.value.field) == (
        "decoder.layers.0.mlp.experts.linear_fc1.weight",
        2,
        "moe_single_grouped_weight",
    )


# ---- GLU interleaving ----------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["per_expert", "single"])
@pytest.mark.parametrize(("etp", "k"), [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_interleaved_expert_fc1_is_one_box_per_block(storage: str, etp: int, k: int) -> None:
    truth = expert_truth(range(E))
    counts = {
        n: torch.zeros(t.shape, dtype=torch.int32) for n, t in truth.items() if "down" not in n
    }
    glu = GluInterleave(experts=k)
    for r in range(etp):
        par = MegatronParallel(rank=r, etp_rank=r, etp_size=etp)
        per_expert = [bridge_interleave(local_fc1(truth, e, etp, r), k) for e in range(E)]
        if storage == "single":
            stacked = torch.stack(per_expert)
            held = slices("decoder.layers.0.mlp.experts.linear_fc1.weight", stacked, par, glu=glu)
        else:
            held = [
                s
                for e, t in enumerate(per_expert)
                for s in slices(
                    f"decoder.layers.0.mlp.experts.linear_fc1.weight{e}", t, par, glu=glu
                )
            ]
        assert len(held) == E * 2 * (F // etp // k)
        register(held, rank=r)
        for s in held:
            assert torch.equal(s.view, truth[s.name][to_slices(s.box)]), (s.name, s.box)
            counts[s.name][to_slices(s.box)] += 1
    assert all(bool((c == 1).all()) for c in counts.values())


def test_interleaved_shared_expert_fc1() -> None:
    p = L + "mlp.shared_experts."
    gate, up = torch.randn(SHARED, H), torch.randn(SHARED, H)
    truth = {p + "gate_proj.weight": gate, p + "up_proj.weight": up}
    glu = GluInterleave(shared_experts=3)
    locals_ = [
        (bridge_interleave(torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]), 3), tp(r, 2))
        for r in range(2)
    ]
    held = check_union(
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", truth, locals_, glu=glu
    )
    assert len(held[0]) == 2 * (SHARED // 2 // 3)
    # The routed experts' setting does not touch shared experts (and vice versa).
    plain = [(torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]), tp(r, 2)) for r in range(2)]
    check_union(
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
        truth,
        plain,
        glu=GluInterleave(experts=3),
    )
