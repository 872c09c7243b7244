from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitplane.reshard.boxes import box_numel
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan
from refitplane.reshard.schedule import ALIGN, link_messages, rank_schedule

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
    assert [c.index for c in chunks] == list(range(len(chunks)))
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


def test_rank_schedule_orders_rounds_by_src_dst() -> None:
    spec = TensorSpec.create("w", [64, 8], "float32")
    specs = {"w": spec}
    sends = tuple(Link(0, d, (Piece("w", ((0, 64), (0, 8))),), 2048) for d in (5, 3))
    plan = RankPlan(0, specs, tuple(sorted(sends, key=lambda link: link.dst)), (), "x")
    sched = rank_schedule(
        plan, TransferConfig(bucket_bytes=512, max_inflight_bytes=1024, num_channels=2)
    )
    assert len(sched.rounds) == 4
    for r, msgs in enumerate(sched.rounds):
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
    assert [[c.tensor for c in m.chunks] for m in msgs] == [["n"], ["w"], ["n"]]


def test_direct_threshold_decides_what_is_packed() -> None:
    spec = TensorSpec.create("w", [4096, 4096], "bfloat16")  # 32 MiB
    small = TensorSpec.create("n", [4096], "float32")
    specs = {"w": spec, "n": small}
    pieces = (Piece("n", ((0, 4096),)), Piece("w", ((0, 4096), (0, 4096))))
    link = Link(0, 1, pieces, sum(box_numel(p.box) * specs[p.tensor].itemsize for p in pieces))
    big = 1 << 30
    alone = link_messages(link, specs, TransferConfig(bucket_bytes=big, max_inflight_bytes=big))
    assert [[c.tensor for c in m.chunks] for m in alone] == [["n"], ["w"]]  # 32 MiB >= 16 MiB
    packed = link_messages(
        link,
        specs,
        TransferConfig(bucket_bytes=big, max_inflight_bytes=big, direct_min_bytes=64 << 20),
    )
    assert [[c.tensor for c in m.chunks] for m in packed] == [["n", "w"]]
