from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitplane.reshard.boxes import box_numel
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan
from refitplane.reshard.schedule import ALIGN, link_messages, rank_schedule
from refitplane.reshard.stages import stage_of

pytestmark = pytest.mark.unit


@st.composite
def links(draw: st.DrawFn) -> tuple[Link, dict[str, TensorSpec]]:
    specs = {}
    pieces = []
    for i in range(draw(st.integers(1, 6))):
        rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        spec = TensorSpec.create(
            f"t{i}", [rows, cols], draw(st.sampled_from(["bfloat16", "float32", "float8_e5m2"]))
        )
        specs[spec.name] = spec
        r0 = draw(st.integers(0, rows - 1))
        r1 = draw(st.integers(r0 + 1, rows))
        pieces.append(Piece(spec.name, ((r0, r1), (0, cols))))
    nbytes = sum(box_numel(p.box) * specs[p.tensor].itemsize for p in pieces)
    return Link(0, 1, tuple(pieces), nbytes), specs


@settings(max_examples=200, deadline=None)
@given(links(), st.integers(4, 3000), st.integers(1, 4))
def test_messages_cover_the_link_within_buckets(
    case: tuple[Link, dict[str, TensorSpec]], bucket: int, channels: int
) -> None:
    link, specs = case
    cfg = TransferConfig(bucket_bytes=bucket, max_inflight_bytes=4 * bucket, num_channels=channels)
    msgs = link_messages(link, specs, cfg)
    chunks = [c for m in msgs for c in m.chunks]
    assert sum(c.nbytes for c in chunks) == link.nbytes
    # Every chunk once (a chunk that travels alone may go before the packed message that
    # was being filled when it came).
    assert sorted(c.index for c in chunks) == list(range(len(chunks)))
    for i, m in enumerate(msgs):
        assert m.round == i
        assert m.channel == i % channels
        assert m.nbytes == m.chunks[-1].offset + m.chunks[-1].nbytes
        item = max(specs[c.tensor].itemsize for c in m.chunks)
        assert m.nbytes <= max(bucket, item * 1)  # a single element may exceed a tiny bucket
        prev_end = 0
        for c in m.chunks:
            assert c.offset % ALIGN == 0
            assert c.offset >= prev_end
            prev_end = c.offset + c.nbytes
        if len(m.chunks) > 1:
            assert all(2 * c.nbytes < bucket and c.nbytes < cfg.direct_min_bytes for c in m.chunks)
    # Both ends derive the same messages.
    assert link_messages(link, specs, cfg) == msgs


def test_rank_schedule_orders_steps_by_src_dst() -> None:
    spec = TensorSpec.create("w", [64, 8], "float32")
    specs = {"w": spec}
    sends = tuple(Link(0, d, (Piece("w", ((0, 64), (0, 8))),), 2048) for d in (5, 3))
    plan = RankPlan(0, specs, tuple(sorted(sends, key=lambda link: link.dst)), (), "x")
    sched = rank_schedule(
        plan, TransferConfig(bucket_bytes=512, max_inflight_bytes=1024, num_channels=2)
    )
    assert len(sched.steps) == 4
    for r, msgs in enumerate(sched.steps):
        assert [(m.src, m.dst) for m in msgs] == [(0, 3), (0, 5)]
        assert {m.channel for m in msgs} == {r % 2}
    assert sched.messages_per_link == {(0, 3): 4, (0, 5): 4}


def test_large_chunks_travel_alone_whatever_the_bucket() -> None:
    spec = TensorSpec.create("w", [8192, 4096], "bfloat16")  # 64 MiB
    small = TensorSpec.create("n", [4096], "float32")
    specs = {"w": spec, "n": small}
    pieces = (
        Piece("n", ((0, 4096),)),
        Piece("w", ((0, 8192), (0, 4096))),
        Piece("n", ((0, 2048),)),
    )
    link = Link(0, 1, pieces, sum(box_numel(p.box) * specs[p.tensor].itemsize for p in pieces))
    msgs = link_messages(
        link, specs, TransferConfig(bucket_bytes=1 << 30, max_inflight_bytes=1 << 31)
    )
    # The large chunk goes alone; the small ones around it still share one message.
    assert [[c.tensor for c in m.chunks] for m in msgs] == [["w"], ["n", "n"]]


def test_direct_threshold_decides_what_is_packed() -> None:
    spec = TensorSpec.create("w", [4096, 4096], "bfloat16")  # 32 MiB
    small = TensorSpec.create("n", [4096], "float32")
    specs = {"w": spec, "n": small}
    pieces = (Piece("n", ((0, 4096),)), Piece("w", ((0, 4096), (0, 4096))))
    link = Link(0, 1, pieces, sum(box_numel(p.box) * specs[p.tensor].itemsize for p in pieces))
    big = 1 << 30
    alone = link_messages(link, specs, TransferConfig(bucket_bytes=big, max_inflight_bytes=big))
    assert [[c.tensor for c in m.chunks] for m in alone] == [["w"], ["n"]]  # 32 MiB >= 16 MiB
    packed = link_messages(
        link,
        specs,
        TransferConfig(bucket_bytes=big, max_inflight_bytes=big, direct_min_bytes=64 << 20),
    )
    assert [[c.tensor for c in m.chunks] for m in packed] == [["n", "w"]]


# Canonical names of a few stages: decoder layers (two digits sort numerically, not as
# text), MoE experts inside a layer, and modules outside any layer.
_NAMES = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.experts.3.up_proj.weight",
    "model.layers.2.input_layernorm.weight",
    "model.layers.10.self_attn.o_proj.weight",
    "model.layers.10.mlp.experts.11.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
)


@st.composite
def staged_links(draw: st.DrawFn) -> tuple[list[Link], dict[str, TensorSpec]]:
    """Links 0 → 2 and 1 → 2 whose pieces (in a random order, as a planner may list them)
    come from several stages."""
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=8, unique=True))
    specs = {}
    for name in names:
        rows, cols = draw(st.integers(1, 24)), draw(st.integers(1, 24))
        specs[name] = TensorSpec.create(
            name, [rows, cols], draw(st.sampled_from(["bfloat16", "float32"]))
        )
    links = []
    for src in (0, 1):
        chosen = draw(st.permutations(names))
        pieces = []
        for name in chosen:
            rows, cols = specs[name].shape
            r0 = draw(st.integers(0, rows - 1))
            pieces.append(Piece(name, ((r0, draw(st.integers(r0 + 1, rows))), (0, cols))))
        nbytes = sum(box_numel(p.box) * specs[p.tensor].itemsize for p in pieces)
        links.append(Link(src, 2, tuple(pieces), nbytes))
    return links, specs


@settings(max_examples=200, deadline=None)
@given(staged_links(), st.integers(16, 2000), st.integers(1, 3))
def test_no_message_spans_two_stages_and_both_ends_agree(
    case: tuple[list[Link], dict[str, TensorSpec]], bucket: int, channels: int
) -> None:
    links, specs = case
    cfg = TransferConfig(bucket_bytes=bucket, max_inflight_bytes=4 * bucket, num_channels=channels)
    for link in links:
        msgs = link_messages(link, specs, cfg)
        assert sum(c.nbytes for m in msgs for c in m.chunks) == link.nbytes
        for m in msgs:
            assert {stage_of(c.tensor) for c in m.chunks} == {m.stage}
        # Stages in order along the link, each stage's messages numbered from 0.
        assert [m.stage for m in msgs] == sorted(m.stage for m in msgs)
        for m in msgs:
            first = next(i for i, other in enumerate(msgs) if other.stage == m.stage)
            assert m.step == m.round - first
            assert m.channel == m.round % channels
    # The receiver (both links) and each sender (its link) compute the same messages.
    receiver = rank_schedule(RankPlan(2, specs, (), tuple(links), "d"), cfg)
    for link in links:
        sender = rank_schedule(RankPlan(link.src, specs, (link,), (), "d"), cfg)
        theirs = [m for m in receiver.messages if m.src == link.src]
        assert list(sender.messages) == theirs
    # One global order: (stage, step), then (src, dst).
    keys = [(m.stage, m.step, m.src, m.dst) for m in receiver.messages]
    assert keys == sorted(keys)
    for step in receiver.steps:
        assert len({(m.stage, m.step) for m in step}) == 1
    stages = receiver.receive_stages(2)
    assert [key for key, _ in stages] == sorted({m.stage for m in receiver.messages})
    for key, names in stages:
        assert names == sorted(
            {c.tensor for m in receiver.messages if m.stage == key for c in m.chunks}
        )


def test_layers_sort_by_index_and_small_tensors_of_one_layer_pack_together() -> None:
    names = [
        "model.layers.10.post_attention_layernorm.weight",
        "model.layers.2.input_layernorm.weight",
        "model.layers.2.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    specs = {n: TensorSpec.create(n, [64], "float32") for n in names}
    pieces = tuple(Piece(n, ((0, 64),)) for n in names)
    link = Link(0, 1, pieces, 4 * 256)
    msgs = link_messages(link, specs, TransferConfig(bucket_bytes=4096, max_inflight_bytes=4096))
    assert [[c.tensor for c in m.chunks] for m in msgs] == [
        ["model.layers.2.input_layernorm.weight", "model.layers.2.post_attention_layernorm.weight"],
        ["model.layers.10.post_attention_layernorm.weight"],
        ["model.norm.weight"],
    ]
    assert [(m.stage, m.step) for m in msgs] == [
        (("model.layers", 2), 0),
        (("model.layers", 10), 0),
        (("model.norm", -1), 0),
    ]
