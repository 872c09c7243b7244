"""Real multi-process Gloo runs of the executor and the golden reference path."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from refitplane.errors import TransferError
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.planner import build_plan
from refitplane.reshard.reference import reference_refit
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transport.gloo import GlooTransport
from tests.integration.reshard.gloo_world import run_world
from tests.integration.reshard.ordered_gloo import OrderedGlooTransport
from tests.integration.reshard.scenarios import SCENARIOS, check_received, make_shards

pytestmark = pytest.mark.integration


def _rank_worker(
    *,
    rank: int,
    world: int,
    port: int,
    scenario: str,
    modes: tuple[str, ...] = ("executor",),
    config: dict[str, Any] | None = None,
    die_rank: int = -1,
    stall_rank: int = -1,
    ordered: bool = False,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    sc = SCENARIOS[scenario]()
    cfg = TransferConfig(**(config or {}))
    is_source = rank in sc.source.ranks()
    layout = sc.source if is_source else sc.target
    transport = (OrderedGlooTransport if ordered else GlooTransport)(
        rank,
        world,
        f"127.0.0.1:{port}".encode(),
        num_channels=cfg.num_channels,
        timeout_s=cfg.timeout_s,
    )
    if rank == stall_rank:
        time.sleep(cfg.timeout_s + 5)
        return {}
    result: dict[str, Any] = {}
    for mode in modes:
        # Fresh storage per mode: destinations start from garbage every time.
        shards = make_shards(layout, rank, fill=is_source)
        if mode == "reference":
            reference_refit(transport, sc.source, sc.target, shards, timeout_s=cfg.timeout_s)
        elif mode == "repeat":
            result.update(_repeat_refits(transport, cfg, sc, layout, rank, shards))
        else:
            plan = build_plan(sc.source, sc.target)

            def progress(done: int, total: int) -> None:
                if rank == die_rank and done > 0:
                    os._exit(17)

            began = time.monotonic()
            try:
                report = Executor(transport, cfg).run(
                    plan.rank_plan(rank), shards, progress=progress
                )
            except TransferError as exc:
                if die_rank < 0 and stall_rank < 0:
                    raise
                # How long this rank's transfer took to fail, from its own start: the
                # processes' start-up (seconds of imports on a loaded machine) is not in it.
                failed = {"type": type(exc).__name__, "message": exc.message}
                return {"failed": failed, "seconds": time.monotonic() - began}
            result.update(
                sent=report.bytes_sent,
                received=report.bytes_received,
                verified=report.tensors_verified,
                tensors=report.tensors_total,
                direct=report.direct_messages,
                packed=report.packed_messages,
                peak=report.staging_peak_bytes,
            )
        if not is_source:
            result[f"mismatches_{mode}"] = check_received(sc.target, rank, shards)
    transport.close()
    return result


def _repeat_refits(
    transport: Any, cfg: TransferConfig, sc: Any, layout: Any, rank: int, shards: Any
) -> dict[str, Any]:
    """Four refits on one executor: the second reuses the first's schedule and views; the
    third gets a new registry over the same tensors (reused too); the fourth new tensors,
    resolved afresh. Destinations are wiped before each, so every refit must deliver every
    byte again."""
    plan = build_plan(sc.source, sc.target).rank_plan(rank)
    ex = Executor(transport, cfg)
    is_source = rank in sc.source.ranks()
    reused, mismatches = [], []
    for attempt in range(4):
        if attempt == 2:
            again = LocalShards()
            for sv in shards:
                again.add(sv.spec, sv.box, sv.tensor)
            shards = again
        if attempt == 3:
            shards = make_shards(layout, rank, fill=is_source)
        elif not is_source:
            for sv in shards:
                sv.tensor.zero_()
        before = ex._prepared
        report = ex.run(plan, shards)
        reused.append(before is not None and ex._prepared is before)
        assert report.tensors_verified == report.tensors_total
        if not is_source:
            mismatches.append(check_received(sc.target, rank, shards))
    return {"reused": reused, "repeat_mismatches": mismatches}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_bytes_arrive_exactly(scenario: str) -> None:
    """Executor and golden reference path, in the same world, both bit-exact."""
    sc = SCENARIOS[scenario]()
    # Small buckets and a tight staging budget force many rounds, packing and ring reuse.
    config = {"bucket_bytes": 512, "max_inflight_bytes": 2048, "num_channels": 2, "timeout_s": 60}
    results = run_world(
        _rank_worker,
        sc.world_size,
        scenario=scenario,
        modes=("executor", "reference"),
        config=config,
    )
    assert sorted(results) == list(range(sc.world_size)), results
    for rank, (status, detail) in results.items():
        assert status == "ok", (rank, detail)
    plan = build_plan(sc.source, sc.target)
    for rank in sc.target.ranks():
        detail = results[rank][1]
        assert detail["mismatches_executor"] == [], (rank, detail["mismatches_executor"])
        assert detail["mismatches_reference"] == [], (rank, detail["mismatches_reference"])
        assert detail["received"] == plan.rank_plan(rank).recv_bytes
        assert detail["verified"] == detail["tensors"] > 0
        assert 0 < detail["peak"] <= 2048
    for rank in sc.source.ranks():
        assert results[rank][1]["sent"] == plan.rank_plan(rank).send_bytes


def test_large_buckets_go_direct_and_match_small_buckets() -> None:
    """Contiguous whole-shard messages bypass staging; packed-only runs agree bit for bit."""
    sc = SCENARIOS["tp4_to_two_tp1"]()
    # 900-byte buckets: each 480-byte "col" shard travels alone, from/to contiguous views.
    big = run_world(
        _rank_worker,
        sc.world_size,
        scenario="tp4_to_two_tp1",
        config={"bucket_bytes": 900, "max_inflight_bytes": 4096},
    )
    small = run_world(
        _rank_worker,
        sc.world_size,
        scenario="tp4_to_two_tp1",
        config={"bucket_bytes": 256, "max_inflight_bytes": 1024},
    )
    for rank in sc.target.ranks():
        assert big[rank][0] == small[rank][0] == "ok"
        assert big[rank][1]["mismatches_executor"] == []
        assert small[rank][1]["mismatches_executor"] == []
        assert big[rank][1]["direct"] > 0


def test_dp_replicas_share_the_load() -> None:
    sc = SCENARIOS["dp2tp2_to_tp1"]()
    stats = build_plan(sc.source, sc.target).stats()
    sent = [stats.send_bytes[r] for r in sc.source.ranks()]
    # Every one of the 4 trainer ranks sends; none sends more than 1.5x the mean.
    assert all(s > 0 for s in sent), sent
    assert stats.send_imbalance <= 1.5, stats.send_imbalance


def test_peer_killed_mid_transfer_fails_others_in_time() -> None:
    """Rank 0 exits once its first group completed. Every rank that receives from it fails
    (none hangs) within its transfer's own timeout, counted from its own start: the bound is
    the product's deadline, not how fast a loaded machine starts five processes."""
    sc = SCENARIOS["tp2_to_tp3"]()
    config = {"bucket_bytes": 128, "max_inflight_bytes": 512, "num_channels": 1, "timeout_s": 20}
    plan = build_plan(sc.source, sc.target)
    needs_rank_0 = sorted(
        r for r in sc.target.ranks() if any(link.src == 0 for link in plan.rank_plan(r).recvs)
    )
    assert needs_rank_0
    # Generous: only a rank that hangs past its own deadline would reach it.
    results = run_world(
        _rank_worker, sc.world_size, scenario="tp2_to_tp3", config=config, die_rank=0, timeout_s=300
    )
    assert 0 not in results  # it died
    for r in needs_rank_0:
        failed, seconds = _failure_of(results, r)
        assert failed["type"] in {"PeerFailure", "TransferTimeout", "TransferError"}, (r, failed)
        # The deadline is 20 s; the margin covers the failure's own handling, not start-up.
        assert seconds < config["timeout_s"] + 10, (r, failed, seconds)


def _failure_of(
    results: dict[int, tuple[str, dict[str, Any]]], rank: int
) -> tuple[dict[str, str], float]:
    """How `rank`'s transfer failed, and how long after its own start."""
    assert rank in results, f"rank {rank} neither finished nor failed: it hung"
    status, detail = results[rank]
    assert status == "ok", (rank, detail)
    assert "failed" in detail, (rank, detail)  # its transfer completed
    return detail["failed"], detail["seconds"]


def test_stalled_peer_times_out() -> None:
    """Rank 1 joins the group, then sleeps past the deadline: its receivers time out (or
    see it leave) within their transfer's own timeout, counted from their own start."""
    sc = SCENARIOS["tp2_to_tp3"]()
    config = {"bucket_bytes": 4096, "max_inflight_bytes": 8192, "num_channels": 1, "timeout_s": 4}
    results = run_world(
        _rank_worker,
        sc.world_size,
        scenario="tp2_to_tp3",
        config=config,
        stall_rank=1,
        timeout_s=300,
    )
    for r in (2, 3, 4):
        failed, seconds = _failure_of(results, r)
        assert failed["type"] in {"TransferTimeout", "PeerFailure"}, (r, failed)
        assert seconds < config["timeout_s"] + 10, (r, failed, seconds)


def test_repeated_refits_reuse_the_schedule_and_stay_exact() -> None:
    sc = SCENARIOS["tp4_to_two_tp1"]()
    config = {"bucket_bytes": 512, "max_inflight_bytes": 2048, "num_channels": 2, "timeout_s": 60}
    results = run_world(
        _rank_worker, sc.world_size, scenario="tp4_to_two_tp1", modes=("repeat",), config=config
    )
    for rank, (status, detail) in sorted(results.items()):
        assert status == "ok", (rank, detail)
        assert detail["reused"] == [False, True, True, False], (rank, detail["reused"])
    for rank in sc.target.ranks():
        assert results[rank][1]["repeat_mismatches"] == [[], [], [], []]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_device_ordered_path_is_exact(scenario: str) -> None:
    """The path GPUs take (unpacking and both ends' checksums queued right after posting,
    no host wait), on Gloo made device-ordered: bit-exact and verified, with packing,
    direct messages and ring reuse."""
    sc = SCENARIOS[scenario]()
    # One channel: completing groups inside `issue` needs every earlier op posted (see
    # OrderedGlooTransport).
    config = {"bucket_bytes": 512, "max_inflight_bytes": 2048, "num_channels": 1, "timeout_s": 60}
    results = run_world(_rank_worker, sc.world_size, scenario=scenario, config=config, ordered=True)
    assert sorted(results) == list(range(sc.world_size)), results
    for rank, (status, detail) in results.items():
        assert status == "ok", (rank, detail)
    for rank in sc.target.ranks():
        detail = results[rank][1]
        assert detail["mismatches_executor"] == [], (rank, detail["mismatches_executor"])
        assert detail["verified"] == detail["tensors"] > 0
