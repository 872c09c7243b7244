"""Megatron parameter rules on plain tensors: names Megatron uses that no CPU model builds
(Transformer Engine's fused norms and `weight{i}` experts, biases), and every error.
MLA, shared experts and the other DeepSeek-era storages: test_megatron_mla_experts.py (their
refusals: test_megatron_refusals.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import to_slices
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.held import HeldSlice, register
from refitplane.trainer.layouts.megatron_slicing import MegatronParallel
from tests.unit.trainer.layouts import megatron_synthetic

pytestmark = pytest.mark.unit

H, HD = 8, 2
DIMS = ModelDims(
    hidden_size=H,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=HD,
    vocab_size=10,
    intermediate_size=6,
    moe_intermediate_size=4,
    num_experts=4,
)


# The rules' slices, for these dimensions (layer 0 of every rank is the model's layer 5).
slices = functools.partial(megatron_synthetic.slices, dims=DIMS)


def assert_reproduces(
    held: list[HeldSlice], truth: dict[str, torch.Tensor], local: torch.Tensor
) -> None:
    for s in held:
        assert s.shape == tuple(truth[s.name].shape), s.name
        assert torch.equal(s.view, truth[s.name][to_slices(s.box)]), (s.name, s.box)
        assert s.view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's layout: per query group, its q heads, then its k head, then its v head."""
    tail = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)],
        dim=1,
    ).reshape(-1, *tail)


@pytest.mark.parametrize("kind", ["weight", "bias"])
@pytest.mark.parametrize(
    ("heads", "groups", "tp"), [(8, 4, 1), (8, 4, 2), (8, 4, 4), (4, 1, 1), (4, 4, 2)]
)
def test_qkv_groups_map_to_q_k_v_exactly_once(kind: str, heads: int, groups: int, tp: int) -> None:
    dims = ModelDims(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=HD,
        vocab_size=10,
    )
    tail = (H,) if kind == "weight" else ()
    layer = "model.layers.5.self_attn."
    truth = {
        f"{layer}q_proj.{kind}": torch.randn(heads * HD, *tail),
        f"{layer}k_proj.{kind}": torch.randn(groups * HD, *tail),
        f"{layer}v_proj.{kind}": torch.randn(groups * HD, *tail),
    }
    full = fused_qkv(*truth.values(), groups)
    counts = {n: torch.zeros(t.shape) for n, t in truth.items()}
    for r in range(tp):
        local = full.chunk(tp)[r].clone()
        held = slices(
            f"decoder.layers.0.self_attention.linear_qkv.{kind}",
            local,
            MegatronParallel(rank=r, tp_rank=r, tp_size=tp),
            dims=dims,
        )
        assert len(held) == 3 * groups // tp  # one box per local group and projection
        assert_reproduces(held, truth, local)
        for s in held:
            counts[s.name][to_slices(s.box)] += 1
    assert all(bool((c == 1).all()) for c in counts.values())


def test_dense_mlp_and_attention_output_on_tensor_parallel_rank_1() -> None:
    par = MegatronParallel(rank=7, tp_rank=1, tp_size=2)
    m = "model.layers.5.mlp."
    gate, up, down = torch.randn(6, H), torch.randn(6, H), torch.randn(H, 6)
    o = torch.randn(H, 16)
    fc1 = torch.cat([gate[3:], up[3:]]).clone()
    held = slices("decoder.layers.0.mlp.linear_fc1.weight", fc1, par)
    assert [(s.name, s.box) for s in held] == [
        (m + "gate_proj.weight", ((3, 6), (0, H))),
        (m + "up_proj.weight", ((3, 6), (0, H))),
    ]
    assert_reproduces(held, {m + "gate_proj.weight": gate, m + "up_proj.weight": up}, fc1)
    fc2 = down[:, 3:].clone()
    assert_reproduces(
        slices("decoder.layers.0.mlp.linear_fc2.weight", fc2, par),
        {m + "down_proj.weight": down},
        fc2,
    )
    proj = o[:, 8:].clone()
    held = slices("decoder.layers.0.self_attention.linear_proj.weight", proj, par)
    assert held[0].box == ((0, H), (8, 16))
    assert_reproduces(held, {"model.layers.5.self_attn.o_proj.weight": o}, proj)


@pytest.mark.parametrize(
    ("megatron", "hf"),
    [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
        ("mlp.linear_fc1.layer_norm_bias", "post_attention_layernorm.bias"),
        ("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
    ],
)
def test_norms_local_and_transformer_engine_names(megatron: str, hf: str) -> None:
    w = torch.randn(H)
    held = slices(f"decoder.layers.0.{megatron}", w, MegatronParallel(rank=0, tp_rank=1, tp_size=2))
    assert [(s.name, s.box) for s in held] == [(f"model.layers.5.{hf}", ((0, H),))]


def test_qk_norms_router_and_final_norm() -> None:
    par = MegatronParallel(rank=0)
    assert slices("decoder.layers.0.self_attention.k_layernorm.weight", torch.ones(HD), par)[
        0
    ].name == ("model.layers.5.self_attn.k_norm.weight")
    router = slices("decoder.layers.0.mlp.router.weight", torch.ones(4, H), par)
    assert (router[0].name, router[0].shape) == ("model.layers.5.mlp.gate.weight", (4, H))
    assert (
        slices("decoder.final_layernorm.weight", torch.ones(H), par)[0].name == "model.norm.weight"
    )


@pytest.mark.parametrize(
    ("tp_rank", "box"), [(0, ((0, 4), (0, H))), (2, ((8, 10), (0, H))), (3, None)]
)
def test_vocab_parallel_rows_are_clipped_to_the_checkpoint_vocab(
    tp_rank: int, box: tuple[tuple[int, int], ...] | None
) -> None:
    local = torch.randn(4, H)  # padded vocabulary 16 over 4 ranks, checkpoint vocabulary 10
    held = slices(
        "embedding.word_embeddings.weight",
        local,
        MegatronParallel(rank=tp_rank, tp_rank=tp_rank, tp_size=4),
    )
    if box is None:
        assert held == []  # padding only
        return
    assert [(s.name, s.shape, s.box) for s in held] == [("model.embed_tokens.weight", (10, H), box)]
    assert held[0].view.data_ptr() == local.data_ptr()


def test_output_layer_is_lm_head_or_the_tied_embedding() -> None:
    par = MegatronParallel(rank=3, tp_rank=0, tp_size=1)
    w = torch.randn(12, H)
    assert slices("output_layer.weight", w, par)[0].name == "lm_head.weight"
    assert slices("output_layer.weight", w, par, tied=True)[0].name == "model.embed_tokens.weight"


def test_sequential_and_transformer_engine_experts_are_numbered_by_expert_parallel_rank() -> None:
    par = MegatronParallel(rank=1, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)  # expert TP 1
    fc1 = torch.randn(8, H)
    for name in (
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight1",
    ):
        held = slices(name, fc1, par)
        assert [(s.name, s.box) for s in held] == [
            ("model.layers.5.mlp.experts.3.gate_proj.weight", ((0, 4), (0, H))),
            ("model.layers.5.mlp.experts.3.up_proj.weight", ((0, 4), (0, H))),
        ]
    down = slices("decoder.layers.0.mlp.experts.linear_fc2.weight0", torch.randn(H, 4), par)
    assert [(s.name, s.box) for s in down] == [
        ("model.layers.5.mlp.experts.2.down_proj.weight", ((0, H), (0, 4)))
    ]


def test_grouped_mlp_weights_are_read_as_megatron_reads_them() -> None:
    """weight1 [H, n*2F/etp] is `view(n, H, -1)`, weight2 [n*F/etp, H] is `view(n, -1, H)`."""
    etp, per_rank = 2, 2
    par = MegatronParallel(rank=5, ep_rank=1, ep_size=2, etp_rank=1, etp_size=etp)
    truth = {}
    fc1, fc2 = [], []
    for e in (2, 3):  # the experts of expert-parallel rank 1
        p = f"model.layers.5.mlp.experts.{e}."
        truth[p + "gate_proj.weight"], truth[p + "up_proj.weight"] = (
            torch.randn(4, H),
            torch.randn(4, H),
        )
        truth[p + "down_proj.weight"] = torch.randn(H, 4)
        fc1.append(torch.cat([truth[p + "gate_proj.weight"][2:], truth[p + "up_proj.weight"][2:]]))
        fc2.append(truth[p + "down_proj.weight"][:, 2:])
    weight1 = torch.stack([w.t() for w in fc1]).reshape(H, -1).clone()
    weight2 = torch.stack([w.t() for w in fc2]).reshape(-1, H).clone()
    held1 = slices("decoder.layers.0.mlp.experts.weight1", weight1, par)
    held2 = slices("decoder.layers.0.mlp.experts.weight2", weight2, par)
    assert len(held1) == 2 * per_rank
    assert len(held2) == per_rank
    assert all(s.box[0] == (2, 4) for s in held1)  # expert-TP rank 1 of 2: rows 2..4 of F=4
    assert all(s.box[1] == (2, 4) for s in held2)
    assert_reproduces(held1, truth, weight1)
    assert_reproduces(held2, truth, weight2)
    assert not held1[0].view.is_contiguous()  # a transposed view, not a copy


def test_layer_index_is_the_global_one() -> None:
    held = slices(
        "decoder.layers.1.input_layernorm.weight",
        torch.ones(H),
        MegatronParallel(rank=0),
        layers={0: 4, 1: 5},
    )
    assert held[0].name == "model.layers.5.input_layernorm.weight"


@pytest.mark.parametrize(
    ("name", "shape", "par", "match"),
    [
        (
            "embedding.position_embeddings.weight",
            (16, H),
            MegatronParallel(rank=2),
            "no Hugging Face",
        ),
        (  # multi-token prediction layers are not mapped
            "mtp.layers.0.enorm.weight",
            (H,),
            MegatronParallel(rank=2),
            "no Hugging Face",
        ),
        (  # the checkpoint has no shared experts
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
            (8, H),
            MegatronParallel(rank=2),
            "no shared experts",
        ),
        (
            "decoder.layers.3.input_layernorm.weight",
            (H,),
            MegatronParallel(rank=2),
            "local layer 3",
        ),
        (
            "decoder.layers.0.self_attention.linear_qkv.weight",
            (23, H),
            MegatronParallel(rank=2),
            r"local shape \[23, 8\]",
        ),
        (
            "decoder.layers.0.self_attention.linear_qkv.weight",
            (8, H),
            MegatronParallel(rank=2, tp_rank=0, tp_size=8),
            "query groups",
        ),
        (
            "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
            (8, H),
            MegatronParallel(rank=2, ep_size=2),
            "local expert 2",
        ),
        (
            "embedding.word_embeddings.weight",
            (4, H),
            MegatronParallel(rank=2, tp_size=2),
            "smaller than the checkpoint",
        ),
        (
            "decoder.layers.0.mlp.linear_fc1.weight",
            (10, H),
            MegatronParallel(rank=2),
            "5 rows x 1 ranks",
        ),
        ("decoder.layers.0.input_layernorm.weight", (H + 1,), MegatronParallel(rank=2), "expected"),
    ],
)
def test_errors_name_the_megatron_parameter_and_rank(
    name: str, shape: tuple[int, ...], par: MegatronParallel, match: str
) -> None:
    with pytest.raises(LayoutError, match=match) as err:
        slices(name, torch.zeros(shape), par)
    assert err.value.tensor == name
    assert err.value.rank == 2


def test_parallel_coordinates_are_validated() -> None:
    with pytest.raises(LayoutError, match="expert parallel rank 2 of size 2"):
        MegatronParallel(rank=0, ep_rank=2, ep_size=2)
    with pytest.raises(LayoutError, match="negative"):
        MegatronParallel(rank=-1)


def test_registering_overlapping_boxes_names_the_rank() -> None:
    t = torch.zeros(4)
    twice = [HeldSlice("model.norm.weight", (4,), ((0, 4),), t)] * 2
    with pytest.raises(LayoutError, match="overlaps") as err:
        register(twice, rank=3)
    assert (err.value.rank, err.value.tensor) == (3, "model.norm.weight")
