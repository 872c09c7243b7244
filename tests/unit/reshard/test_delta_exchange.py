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
