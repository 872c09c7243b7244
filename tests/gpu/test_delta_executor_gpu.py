"""Delta refits through the executor between two GPUs (nccl4py): the sender's batched scan
and gather, the receiver's applies posted group by group (`delta_apply.ApplyRoom`, no host
wait), in place into parameters ("whole") and into staging slices unpacked into strided
views ("tp2"); every refit byte-exact, the sender's base advanced to what it sent."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from refitplane.testing.nccl_world import run_nccl_world

pytestmark = [pytest.mark.gpu(count=2)]

MiB = 1 << 20
# Changed fraction of the elements per refit: nothing, index payloads, bitmap payloads, and
# enough that "auto" sends some messages dense.
FRACTIONS = (0.001, 0.0, 0.05, 0.3, 0.7)


def _updated(name: str, full: torch.Tensor, steps: int) -> torch.Tensor:
    """`full` (the tensor's first version) after `steps` updates: each flips the lowest bit
    of a seeded `FRACTIONS[step]` of its elements."""
    words = full.reshape(-1).view(torch.int16)
    for step in range(steps):
        digest = hashlib.sha256(f"{name}/{step}".encode()).digest()
        gen = torch.Generator(device=full.device).manual_seed(int.from_bytes(digest[:6], "little"))
        picked = torch.rand(words.numel(), device=full.device, generator=gen) < FRACTIONS[step]
        words[picked] ^= 1
    return full


def _set_version(
    layout: Any, rank: int, shards: Any, steps: int, device: torch.device
) -> list[str]:
    """Sender: write version `steps` into its shards. Receiver: the boxes that differ from it."""
    from refitplane.reshard.boxes import to_slices
    from refitplane.testing.p2p_cases import _truth

    bad = []
    for t in layout:
        full = _updated(t.spec.name, _truth(t.spec, device), steps)
        for box in t.boxes.get(rank, ()):
            local = shards.view(t.spec.name, box)
            if rank == 0:
                local.copy_(full[to_slices(box)])
            elif not torch.equal(local.view(torch.uint8), full[to_slices(box)].view(torch.uint8)):
                bad.append(f"{t.spec.name}{list(box)}")
    return bad


def _delta_worker(
    *,
    rank: int,
    world: int,
    transport: Any,
    barrier: Any,
    case_name: str,
    gib: float,
    rates: tuple[float | None, ...] = (),
) -> dict[str, Any]:
    from refitplane.reshard.config import TransferConfig
    from refitplane.reshard.delta_base import DeltaSnapshot
    from refitplane.reshard.delta_exchange import DeltaLinks
    from refitplane.reshard.executor import Executor
    from refitplane.testing import p2p_cases as pc

    case = pc.make_case(case_name, gib)
    layout = case.source if rank == 0 else case.target
    shards = pc.make_shards(layout, rank, transport.device, fill=True)  # both hold version 0
    cfg = TransferConfig(
        bucket_bytes=64 * MiB, num_channels=2, max_inflight_bytes=256 * MiB, timeout_s=120
    )
    executor = Executor(transport, cfg)
    plan = pc.rank_plan(case, rank)
    snapshot = DeltaSnapshot("device")
    if rank == 0:
        snapshot.capture(shards, 1)
    refits = []
    for steps in range(1, len(FRACTIONS) + 1):
        if rank == 0:
            _set_version(layout, rank, shards, steps, transport.device)
        links = DeltaLinks(
            peers=frozenset({1 - rank}),
            base=snapshot.base_for(shards) if rank == 0 else None,
            current=shards if rank == 0 else None,
            # The link rate "auto" decides against (None: the executor's; 0: none).
            link_bytes_per_s=rates[steps - 1] if rates and rank == 0 else None,
        )
        report = executor.run(plan, shards, delta=links)
        if rank == 0:
            snapshot.after_send(shards, steps + 1, report)  # as the agent does
        refits.append(
            {
                "full_links": report.delta_full_links,
                "tables": report.delta_tables,
                "base_needed": report.delta_base_needed,
                "snapshot_bytes": snapshot.nbytes,
                "delta_messages": report.delta_messages,
                "messages": report.messages,
                "wire": report.bytes_sent if rank == 0 else report.bytes_received,
                "full": report.bytes_full,
                "verified": report.tensors_verified,
                "tensors": report.tensors_total,
                "advanced": report.delta_base_advanced,
                "mismatches": (
                    _set_version(layout, rank, shards, steps, transport.device) if rank == 1 else []
                ),
            }
        )
    return {"refits": refits}


def _exact_refits(**kwargs: Any) -> list[dict[str, Any]]:
    """The sender's refits of a two-GPU world (`_delta_worker`), each checked byte-exact,
    verified, with the same delta messages on both ends and the base advanced."""
    results = run_nccl_world(_delta_worker, 2, channels=2, timeout_s=150, gib=1, **kwargs)
    for rank in (0, 1):
        status, detail = results[rank]
        assert status == "ok", detail
    sender, receiver = results[0][1]["refits"], results[1][1]["refits"]
    for i, (sent, got) in enumerate(zip(sender, receiver, strict=True)):
        assert got["mismatches"] == [], (i, got)
        assert got["verified"] == got["tensors"] > 0, (i, got)
        assert sent["delta_messages"] == got["delta_messages"], i
        assert sent["full_links"] == got["full_links"], i  # both ends agreed
        # One replica fed whole: the scan advances the base (a full-path link scans nothing).
        assert sent["advanced"] or sent["full_links"], i
    return list(sender)


@pytest.fixture
def no_link_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fraction rule (and the rates a test gives) alone: no rate measured on this
    machine's link decides (`delta_cost.never_pays` would run a fast link in full)."""
    monkeypatch.setenv("REFIT_DELTA_LINK_GBPS", "off")


@pytest.mark.usefixtures("no_link_rate")
@pytest.mark.parametrize("case_name", ["whole", "tp2"])
def test_delta_refits_between_two_gpus_are_byte_exact(case_name: str) -> None:
    sender = _exact_refits(case_name=case_name)
    # Sparse updates go as deltas and move less than a full refit.
    assert sender[0]["delta_messages"] == sender[0]["messages"]
    assert sender[0]["wire"] < sender[0]["full"] // 50
    assert sender[1]["wire"] == 0
    assert sender[4]["delta_messages"] == 0  # 70 % changed: over max_changed, dense


@pytest.mark.usefixtures("no_link_rate")
def test_messages_that_go_dense_unscanned_keep_the_base_exact() -> None:
    """In "auto" against a link rate (`delta_cost`): a link faster than any scan sends every
    message dense, unscanned, its base copied; the next refits' deltas against that base
    (the fraction rule alone, then at 5e10 B/s a sampled choice per message) stay
    byte-exact."""
    sender = _exact_refits(case_name="whole", rates=(1e18, 1e18, 0.0, 5e10, 5e10))
    assert sender[0]["delta_messages"] == sender[1]["delta_messages"] == 0
    assert sender[0]["wire"] == sender[0]["full"]
    assert sender[2]["delta_messages"] == sender[2]["messages"]  # 5 % against the copied base
    assert sender[3]["wire"] < sender[3]["full"]  # 30 %: bitmaps beat a 50 GB/s link
    assert sender[4]["delta_messages"] == 0  # 70 %: dense


def test_a_link_no_delta_can_beat_runs_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """REFIT_DELTA_LINK_GBPS far above any scan (`delta_cost.never_pays`): the first delta
    refit (no agreement yet) swaps its header tables and sends every message dense
    unscanned; its checksum exchange tells the receiver, and every later delta refit runs
    exactly the full path: no header table, no scan, no base (released), byte-exact."""
    monkeypatch.setenv("REFIT_DELTA_LINK_GBPS", "1000000")
    sender = _exact_refits(case_name="whole")
    assert sender[0]["full_links"] == 0
    assert sender[0]["tables"] == 1
    for refit in sender:
        assert refit["delta_messages"] == 0
        assert refit["wire"] == refit["full"]
        assert not refit["base_needed"]
        assert refit["snapshot_bytes"] == 0
    for refit in sender[1:]:
        assert refit["full_links"] == 1
        assert refit["tables"] == 0
        assert not refit["advanced"]
