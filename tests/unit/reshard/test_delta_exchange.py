"""A sender's delta exchange resolves its base's views once and keeps them only while the base
registry lives (the snapshot's memory must go when the snapshot is released)."""

from __future__ import annotations

import gc

import torch

from refitplane.reshard import delta_images
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.delta import Encoding, apply_delta
from refitplane.reshard.delta_exchange import DeltaExchange, DeltaLinks
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.message_io import resolve_messages
from refitplane.reshard.planner import build_plan
from refitplane.reshard.schedule import rank_schedule
from refitplane.reshard.shards import LocalShards

SHAPES = {"w": (64, 32), "norm": (7,), "v": (40, 10)}


def _sender() -> tuple[list, LocalShards, LocalShards, dict]:
    src, dst = LayoutBuilder(), LayoutBuilder()
    for name, shape in SHAPES.items():
        spec = TensorSpec.create(name, list(shape), "bfloat16")
        whole = tuple((0, n) for n in shape)
        src.add(spec, 0, whole)
        dst.add(spec, 1, whole)
    plan = build_plan(src.build(), dst.build()).rank_plan(0)
    config = TransferConfig(bucket_bytes=2048, max_inflight_bytes=8192, direct_min_bytes=1024)
    current, base = LocalShards(), LocalShards()
    g = torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        spec = plan.specs[name]
        whole = tuple((0, n) for n in shape)
        values = torch.randn(shape, generator=g).to(torch.bfloat16)
        current.add(spec, whole, values.clone())
        base.add(spec, whole, values.clone())
    steps = resolve_messages(plan, rank_schedule(plan, config), current)
    sends = [(m, io) for step in steps for m, io in step if io is not None and m.src == 0]
    return sends, current, base, plan.specs


def test_base_views_are_kept_while_the_base_lives_and_payloads_stay_exact() -> None:
    sends, current, base, specs = _sender()
    assert any(io.direct is None for _, io in sends)  # a staged message (the norm) too
    kept = None
    for step in range(3):
        old = LocalShards()
        for sv in current:
            old.add(sv.spec, sv.box, sv.tensor.clone())
        for sv in current:
            sv.tensor.view(-1)[step::5] += 1  # some elements of every tensor change
        links = DeltaLinks(peers=frozenset({1}), base=base, current=current)
        exchange = DeltaExchange(0, links, torch.device("cpu"))
        exchange.encode(sends, specs)
        assert exchange.advanced  # one replica fed whole: the base now holds what is sent
        assert all(torch.equal(b.tensor, c.tensor) for b, c in zip(base, current, strict=True))
        views = delta_images._BASE_VIEWS[base]
        assert kept is None or views is kept  # resolved once, then reused
        kept = views
        for m, io in sends:
            delta = exchange.messages[(m.src, m.dst, m.round)]
            assert delta.header.encoding is not Encoding.DENSE
            if io.direct is None:
                continue  # staged: its image is the packed current bytes
            # The receiver's old bytes of a direct message, with the payload applied.
            (chunk,) = m.chunks
            image = old.view(chunk.tensor, chunk.box).contiguous().view(-1).view(torch.uint8)
            apply_delta(image, delta.header, delta.word, delta.payload)
            assert torch.equal(image, io.direct)
    del base, links, exchange, views, kept
    gc.collect()
    assert len(delta_images._BASE_VIEWS) == 0  # the released base takes its views along


def _exchange(links: DeltaLinks, sends: list, specs: dict) -> DeltaExchange:
    exchange = DeltaExchange(0, links, torch.device("cpu"))
    exchange.encode(sends, specs)
    exchange.launch_payloads()  # (the base copies of the messages that go dense unscanned)
    return exchange


def _dense_rows(exchange: DeltaExchange) -> list[int]:
    (table,) = exchange.headers_out.values()
    return [r for r, encoding, _ in table.tolist() if encoding == Encoding.DENSE]


def test_auto_deltas_go_dense_where_the_link_is_faster_and_the_base_still_advances() -> None:
    """With a link rate, "auto" sends dense what cannot beat the link (`delta_cost`): on a
    link faster than any scan every message goes dense, unscanned, and the base still ends
    holding what was sent; on a slow link every message is a delta, as without a rate; in
    between, a sample of each message decides: the one with half its words changed goes
    dense, the others (a few words changed) stay deltas, every payload exact."""
    sends, current, base, specs = _sender()
    rounds = sorted(m.round for m, _ in sends)
    for step, (rate, dense) in enumerate(((1e18, rounds), (1e6, []), (None, []))):
        for sv in current:
            sv.tensor.view(-1)[step::7] += 1
        links = DeltaLinks(frozenset({1}), base, current=current, link_bytes_per_s=rate)
        exchange = _exchange(links, sends, specs)
        assert exchange.advanced
        assert all(torch.equal(b.tensor, c.tensor) for b, c in zip(base, current, strict=True))
        assert _dense_rows(exchange) == dense, rate
        assert len(exchange.messages) == len(sends) - len(dense)
    # Every second element of "norm" and "v" changes, a few of "w"'s: at a rate where a delta
    # of a few words wins and one of half the words does not, their message goes dense.
    old = {sv.spec.name: sv.tensor.clone() for sv in current}
    for sv in current:
        sv.tensor.view(-1)[:: 9 if sv.spec.name == "w" else 2] += 1
    dense = [m.round for m, _ in sends if m.chunks[0].tensor != "w"]
    links = DeltaLinks(frozenset({1}), base, current=current, link_bytes_per_s=5e10)
    exchange = _exchange(links, sends, specs)
    assert _dense_rows(exchange) == dense
    assert all(torch.equal(b.tensor, c.tensor) for b, c in zip(base, current, strict=True))
    checked = 0
    for m, io in sends:
        delta = exchange.messages.get((m.src, m.dst, m.round))
        if delta is None:
            continue
        (chunk,) = m.chunks
        view = old[chunk.tensor][tuple(slice(a, b) for a, b in chunk.box)]
        image = view.contiguous().view(-1).view(torch.uint8)
        apply_delta(image, delta.header, delta.word, delta.payload)
        assert torch.equal(image, io.direct)
        checked += 1
    assert checked == 2  # "w"'s two messages
