"""The orchestrator-facing models round-trip through protobuf; they carry no protobuf types."""

from __future__ import annotations

import pytest

from refitplane.protocol import Backend, MemberState, RefitState, Role
from refitplane.protocol.convert import (
    refit_from_proto,
    refit_to_proto,
    topology_from_proto,
    topology_to_proto,
)
from refitplane.protocol.models import (
    Member,
    PhaseTiming,
    RankProgress,
    Refit,
    Replica,
    Topology,
)

pytestmark = pytest.mark.unit


def test_refit_round_trip():
    refit = Refit(
        refit_id="r",
        job="j",
        version=3,
        state=RefitState.TRANSFERRING,
        target_replicas=["a"],
        idempotency_key="k",
        bytes_total=100,
        bytes_done=40,
        timings=[PhaseTiming(phase=RefitState.PENDING, seconds=0.5)],
        ranks=[RankProgress(member_id="m", bytes_received=40, bytes_total=100)],
        plan_digest="p",
        group_epoch=2,
        coalesced=4,
    )
    assert refit_from_proto(refit_to_proto(refit)) == refit
    assert refit.fraction_done == 0.4
    assert not refit.terminal
    assert refit.model_dump(mode="json")["state"] == "TRANSFERRING"


def test_topology_round_trip_with_and_without_group():
    member = Member(
        member_id="m",
        job="j",
        role=Role.GENERATOR,
        replica_id="a",
        state=MemberState.BUSY,
        group_rank=2,
        labels={"x": "y"},
    )
    topo = Topology(
        job="j",
        members=[member],
        replicas=[
            Replica(
                replica_id="a", version=2, state=MemberState.READY, world_size=1, member_ids=["m"]
            )
        ],
        group_epoch=1,
        group_size=3,
        backend=Backend.NCCL,
        committed_version=2,
        healthy=True,
    )
    assert topology_from_proto(topology_to_proto(topo)) == topo
    bare = Topology(job="j")
    assert topology_from_proto(topology_to_proto(bare)) == bare
