"""A run armed at PrepareRefit (`Executor.arm`, `TransferRun.arm`): built up to its first
post before StartTransfer, so the start goes straight to posting.

Arming must change nothing a peer can see: the same groups posted in the same order with the
same bytes, verified, as a run built at the start; and it must post, launch or stage nothing
before the start, so that a refit aborted after its prepare leaves nothing behind. Two ranks
over the in-process loopback transport, bytes moved and checksummed for real.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from refitplane.reshard.boxes import full_box
from refitplane.reshard.executor import Executor
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.staged import StagedShards
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import Handle, P2POp
from tests.unit.reshard.loopback import (
    DIRECT_CONFIG,
    LoopbackHub,
    LoopbackTransport,
    bf16_pair_shards,
    embedding_then_layers,
    pair_plans,
    run_pair,
)

pytestmark = pytest.mark.unit

CONFIG = DIRECT_CONFIG


class PostRecorder(LoopbackTransport):
    """The loopback transport, recording every group posted: (channel, per op: send or
    receive, peer, size, and what a send carries)."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        super().__init__(hub, rank, 2, CONFIG.num_channels)
        self.posts: list[tuple[int, tuple[tuple[bool, int, int, bytes], ...]]] = []

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        self.posts.append(
            (
                channel,
                tuple(
                    (
                        op.send,
                        op.peer,
                        op.buffer.numel(),
                        op.buffer.numpy().tobytes() if op.send else b"",
                    )
                    for op in ops
                ),
            )
        )
        return super().issue(channel, ops, deadline)


def _refit(
    plans: tuple[RankPlan, RankPlan], shards: tuple[LocalShards, LocalShards], *, armed: bool
) -> tuple[list[PostRecorder], dict[int, TransferReport], dict[int, Executor]]:
    """One refit between ranks 0 and 1, each armed first (or not), then started together."""
    hub = LoopbackHub()
    transports = [PostRecorder(hub, rank) for rank in (0, 1)]
    executors = {rank: Executor(transports[rank], CONFIG) for rank in (0, 1)}
    if armed:
        for rank in (0, 1):
            assert executors[rank].arm("r1", plans[rank], shards[rank]) is not None
        # Armed: nothing posted, nothing on the wire.
        assert [t.posts for t in transports] == [[], []]
        assert not any(hub.mail.values())
    reports: dict[int, TransferReport] = {}
    errors = run_pair(
        hub,
        transports,
        plans,
        shards,
        CONFIG,
        reports,
        executors=[executors[0], executors[1]],
        armed="r1",
    )
    assert not errors, errors
    return transports, reports, executors


def test_an_armed_run_posts_what_a_run_built_at_the_start_posts() -> None:
    specs = embedding_then_layers()
    plans = pair_plans(specs)
    values, source, target = bf16_pair_shards(specs)
    built, built_reports, _ = _refit(plans, (source, target), armed=False)
    for name, value in values.items():
        assert torch.equal(target.view(name, target.views_of(name)[0].box), value)
    _, source2, target2 = bf16_pair_shards(specs)
    armed, armed_reports, _ = _refit(plans, (source2, target2), armed=True)
    for name, value in values.items():
        assert torch.equal(target2.view(name, target2.views_of(name)[0].box), value), name
    for rank in (0, 1):
        assert armed[rank].posts == built[rank].posts, f"rank {rank} posted otherwise"
        assert armed_reports[rank].tensors_verified == built_reports[rank].tensors_verified
        assert armed_reports[rank].armed_seconds > 0
        assert built_reports[rank].armed_seconds == 0
    assert armed_reports[1].tensors_verified == len(specs)


def test_arming_adds_the_leading_direct_steps_and_stops_at_the_first_packed_one() -> None:
    specs = embedding_then_layers()
    plans = pair_plans(specs)
    _, source, target = bf16_pair_shards(specs)
    for plan, shards in zip(plans, (source, target), strict=True):
        hub = LoopbackHub()
        executor = Executor(LoopbackTransport(hub, plan.rank, 2, CONFIG.num_channels), CONFIG)
        held = executor.arm("r1", plan, shards)
        assert held is not None
        run = held.run
        # The embedding (16 KiB) fills a group at once: posted first thing at the start.
        assert run.next_step == 1
        assert run.flush_first
        first = run.steps[0]
        assert [m.chunks[0].tensor for m, _ in first] == ["model.embed_tokens.weight"]
        assert all(io is not None and io.direct is not None for _, io in first)
        assert run.report.messages == 1
        assert run.receives_posted is False


def _copy(shards: LocalShards) -> LocalShards:
    """Another registry of the same boxes over other memory."""
    out = LocalShards()
    for sv in shards:
        out.add(sv.spec, sv.box, sv.tensor.clone())
    return out


def test_a_start_for_another_refit_or_other_shards_builds_its_own_run() -> None:
    specs = embedding_then_layers()
    plans = pair_plans(specs)
    values, source, target = bf16_pair_shards(specs)
    hub = LoopbackHub()
    transports = [LoopbackTransport(hub, rank, 2, CONFIG.num_channels) for rank in (0, 1)]
    executors = [Executor(t, CONFIG) for t in transports]
    # Rank 0 armed for an aborted refit, rank 1 with a registry since replaced.
    assert executors[0].arm("aborted", plans[0], source) is not None
    assert executors[1].arm("r2", plans[1], _copy(target)) is not None
    reports: dict[int, TransferReport] = {}

    def run(rank: int, shards: LocalShards) -> None:
        reports[rank] = executors[rank].run(plans[rank], shards, armed="r2")

    threads = [
        threading.Thread(target=run, args=(0, source)),
        threading.Thread(target=run, args=(1, target)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(reports) == [0, 1]
    assert reports[0].armed_seconds == 0
    assert reports[1].armed_seconds == 0
    assert reports[1].tensors_verified == len(specs)
    for name, value in values.items():
        assert torch.equal(target.view(name, target.views_of(name)[0].box), value)
    assert executors[0].armed_shards("aborted") is None  # dropped by the run


def test_a_staged_receiver_is_not_armed() -> None:
    specs = embedding_then_layers()
    plans = pair_plans(specs)
    hub = LoopbackHub()
    executor = Executor(LoopbackTransport(hub, 1, 2, CONFIG.num_channels), CONFIG)
    staged = StagedShards("cpu", lambda *_: None)
    for spec in specs.values():
        staged.add_staged(spec, full_box(spec.shape))
    assert executor.arm("r1", plans[1], staged) is None
    assert executor.armed_shards("r1") is None
