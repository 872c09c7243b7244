"""The link decision of "auto" deltas between two real Gloo processes: on a link no delta can
beat (REFIT_DELTA_LINK_GBPS high, `delta_cost.never_pays`), both ends agree in one refit's
checksum exchange and the next delta refit runs exactly the full path (no header table, no
scan, the sender's base untouched and reported unneeded); on a slow link deltas stay, exact."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from refitplane.reshard.config import TransferConfig
from refitplane.reshard.delta_base import DeltaSnapshot
from refitplane.reshard.delta_exchange import DeltaLinks
from refitplane.reshard.executor import Executor
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.planner import build_plan
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transport.gloo import GlooTransport
from tests.integration.reshard.gloo_world import run_world

pytestmark = pytest.mark.integration

SHAPES = {"w": (64, 48), "norm": (7,), "v": (40, 10)}
REFITS = 3
# What each refit's `TransferReport` says, by the names the assertions use.
REPORTED = {
    "full_links": "delta_full_links",
    "tables": "delta_tables",
    "delta_messages": "delta_messages",
    "messages": "messages",
    "full": "bytes_full",
    "verified": "tensors_verified",
    "tensors": "tensors_total",
    "base_needed": "delta_base_needed",
}


def _version(name: str, shape: tuple[int, ...], version: int) -> torch.Tensor:
    """Tensor `name` at `version`: seeded values, then per version a few elements changed."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    values = torch.randn(shape, generator=g).to(torch.bfloat16)
    flat = values.view(-1)
    for v in range(1, version + 1):
        flat[v::11] += 1
    return values


def _whole(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


def _worker(*, rank: int, world: int, port: int, gbps: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ["REFIT_DELTA_LINK_GBPS"] = gbps  # the rate the sender decides against
    # Rank 0 holds every tensor whole, rank 1 needs it whole.
    layouts = []
    for holder in (0, 1):
        builder = LayoutBuilder()
        for name, shape in SHAPES.items():
            builder.add(TensorSpec.create(name, list(shape), "bfloat16"), holder, _whole(shape))
        layouts.append(builder.build())
    plan = build_plan(*layouts).rank_plan(rank)
    sender = rank == 0
    shards = LocalShards()
    for name, shape in SHAPES.items():
        start = _version(name, shape, 0) if sender else torch.zeros(shape, dtype=torch.bfloat16)
        shards.add(plan.specs[name], _whole(shape), start)
    config = TransferConfig(bucket_bytes=2048, max_inflight_bytes=8192, num_channels=1)
    transport = GlooTransport(
        rank, world, f"127.0.0.1:{port}".encode(), num_channels=1, timeout_s=30
    )
    executor = Executor(transport, config)
    snapshot = DeltaSnapshot("host")
    refits: list[dict[str, Any]] = []
    executor.run(plan, shards)  # the first refit: in full
    if sender:
        snapshot.capture(shards, 1)  # (a base held from before, whatever the link)
    for version in range(1, REFITS + 1):
        if sender:
            for sv in shards:
                sv.tensor.copy_(_version(sv.spec.name, tuple(sv.tensor.shape), version))
        base = snapshot.base_for(shards) if sender else None
        before = [sv.tensor.clone() for sv in base] if base is not None else []
        links = DeltaLinks(
            peers=frozenset({1 - rank}), base=base, current=shards if sender else None
        )
        report = executor.run(plan, shards, delta=links)
        refits.append(
            {key: getattr(report, field) for key, field in REPORTED.items()}
            | {
                "wire": report.bytes_sent if sender else report.bytes_received,
                "had_base": base is not None,
                "base_untouched": all(
                    torch.equal(sv.tensor, old) for sv, old in zip(base or (), before, strict=True)
                ),
                "exact": sender
                or all(
                    torch.equal(sv.tensor, _version(sv.spec.name, tuple(sv.tensor.shape), version))
                    for sv in shards
                ),
            }
        )
        if sender:
            snapshot.after_send(shards, version + 1, report)  # as the agent does
    transport.close()
    return {"refits": refits, "snapshot_bytes": snapshot.nbytes}


def _refits(gbps: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    results = run_world(_worker, 2, timeout_s=120, gbps=gbps)
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", (rank, detail)
    sender, receiver = results[0][1]["refits"], results[1][1]["refits"]
    for i, (sent, got) in enumerate(zip(sender, receiver, strict=True)):
        assert got["exact"], i
        assert got["verified"] == got["tensors"] > 0, (i, got)
        assert sent["full_links"] == got["full_links"], i  # both ends agreed
        assert sent["delta_messages"] == got["delta_messages"], i
    return sender, receiver, results[0][1]["snapshot_bytes"]


def test_a_link_no_delta_can_beat_runs_the_full_path_and_keeps_no_base() -> None:
    sender, receiver, snapshot_bytes = _refits("1000000")
    # The first full refit's checksum exchange told the receiver that this link runs in
    # full: every delta refit after it does, its base neither scanned nor copied into, then
    # dropped (the agent's delta base goes the same way: `dataplane._keep_delta_base`).
    for sent, got in zip(sender, receiver, strict=True):
        assert sent["full_links"] == got["full_links"] == 1
        assert sent["tables"] == got["tables"] == 0  # no header table either way
        assert sent["delta_messages"] == 0
        assert sent["wire"] == sent["full"] == got["wire"]
        assert not sent["base_needed"]
    assert [s["had_base"] for s in sender] == [True] + [False] * (REFITS - 1)
    assert sender[0]["base_untouched"]
    assert snapshot_bytes == 0


def test_a_slow_link_keeps_exact_deltas() -> None:
    """At 0.001 GB/s every message is a delta (the header tables swapped, the base kept)."""
    sender, receiver, snapshot_bytes = _refits("0.001")
    for sent, got in zip(sender, receiver, strict=True):
        assert sent["full_links"] == got["full_links"] == 0
        assert sent["tables"] == got["tables"] == 1
        assert sent["delta_messages"] == sent["messages"] > 0
        assert sent["wire"] < sent["full"]
        assert sent["base_needed"]
        assert sent["had_base"]
    assert snapshot_bytes > 0
