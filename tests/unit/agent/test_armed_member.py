"""A data-plane rank arms its run after reporting prepared (`DataPlaneMember._arm`), and its
StartTransfer runs that run: on the trainer's command thread in order, on a vLLM worker from
vLLM's own thread, which may come first. A run armed for a refit that is then aborted is
dropped; a refit whose update already started is not armed behind it, nor one prepared
while another transfer still runs; a delta refit, which
exchanges headers with its peers first, builds at the start; REFIT_ARM_AT_PREPARE=0 arms
nothing. Two ranks over the in-process loopback transport, bytes moved and verified for
real; the session is a recorder of the reports (the gRPC path is the agents' integration
tests')."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest
import torch

from refitplane.agent import dataplane
from refitplane.agent.dataplane import DataPlaneMember
from refitplane.agent.session import AgentSession
from refitplane.protocol.messages import AbortRefitCmd, PrepareRefitCmd, StartTransferCmd
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.plan import RankPlan
from tests.unit.reshard.loopback import (
    DIRECT_CONFIG,
    LoopbackHub,
    LoopbackTransport,
    bf16_pair_shards,
    embedding_then_layers,
    pair_plans,
)

pytestmark = pytest.mark.unit

CONFIG = DIRECT_CONFIG


class Reports:
    """What the member reports, by name (the session's `report_*` methods)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("report_"):
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, {"args": args, **kwargs}))

        return record

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for call, kwargs in self.calls if call == name]


def _pair() -> tuple[list[DataPlaneMember], list[Reports], tuple[RankPlan, RankPlan], Any]:
    specs = embedding_then_layers(2)
    plans = pair_plans(specs)
    values, source, target = bf16_pair_shards(specs)
    hub = LoopbackHub()
    members, reports = [], []
    for rank, shards in enumerate((source, target)):
        member = DataPlaneMember(
            (lambda s: lambda: s)(shards), device=torch.device("cpu"), run_on_start=rank == 0
        )
        member.transport = LoopbackTransport(hub, rank, 2, CONFIG.num_channels)
        recorder = Reports()
        member.attach(cast(AgentSession, recorder))
        members.append(member)
        reports.append(recorder)
    return members, reports, plans, (values, target)


def _prepare(member: DataPlaneMember, plan: RankPlan, refit_id: str = "r1") -> None:
    member.on_prepare_refit(
        PrepareRefitCmd(
            refit_id,
            1,
            0,
            plan=plan,
            config=CONFIG,
            plan_digest=plan.plan_digest,
            plan_rank=plan.rank,
        )
    )


def _armed(member: DataPlaneMember, refit_id: str) -> bool:
    executor = member._executor
    return executor is not None and executor.armed_shards(refit_id) is not None


def test_prepare_arms_and_the_start_runs_the_armed_run() -> None:
    members, reports, plans, (values, target) = _pair()
    for member, plan in zip(members, plans, strict=True):
        _prepare(member, plan)
        assert _armed(member, "r1")
    # The trainer's start runs on its command thread; the receiver's from "vLLM's" thread.
    receiver = threading.Thread(target=members[1].run_transfer, args=("r1",))
    receiver.start()
    members[0].on_start_transfer(StartTransferCmd("r1", 1))
    receiver.join(timeout=60)
    assert not receiver.is_alive()
    for member, recorder in zip(members, reports, strict=True):
        assert len(recorder.named("report_transfer_done")) == 1
        assert member.last_report is not None
        assert member.last_report.armed_seconds > 0
        assert not _armed(member, "r1")
    assert reports[1].named("report_transfer_done")[0]["tensors_verified"] == len(values)
    for name, value in values.items():
        assert torch.equal(target.view(name, target.views_of(name)[0].box), value)


def test_an_aborted_refit_drops_its_armed_run() -> None:
    members, _, plans, _ = _pair()
    _prepare(members[0], plans[0])
    assert _armed(members[0], "r1")
    members[0].on_abort_refit(AbortRefitCmd("r1", "CANCELLED", "cancelled"))
    assert not _armed(members[0], "r1")


def test_a_refit_already_running_is_not_armed_behind_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    members, _, plans, _ = _pair()
    member = members[1]
    monkeypatch.setattr(dataplane, "ARM_AT_PREPARE", False)
    _prepare(member, plans[1])
    # A vLLM worker's update took the prepared refit (as `run_transfer` does) before the
    # command thread came to arm it.
    with member._ready:
        member._prepared.pop("r1")
    monkeypatch.setattr(dataplane, "ARM_AT_PREPARE", True)
    member._arm(PrepareRefitCmd("r1", 1, 0, plan=plans[1], config=CONFIG))
    assert not _armed(member, "r1")


def test_a_delta_refit_and_the_setting_off_arm_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    members, _, plans, _ = _pair()
    delta = TransferConfig(
        bucket_bytes=16384, max_inflight_bytes=65536, num_channels=2, timeout_s=30, delta="on"
    )
    members[1].on_prepare_refit(
        PrepareRefitCmd("r1", 1, 0, plan=plans[1], config=delta, delta_peers=frozenset({0}))
    )
    assert not _armed(members[1], "r1")
    monkeypatch.setattr(dataplane, "ARM_AT_PREPARE", False)
    _prepare(members[0], plans[0], "r2")
    assert not _armed(members[0], "r2")


def test_nothing_is_armed_while_another_transfer_runs() -> None:
    """An aborted refit may still be unwinding on vLLM's thread when the next is prepared:
    arming would touch what that run uses (launch tables, the channels' streams)."""
    members, _, plans, _ = _pair()
    receiver = members[1]
    _prepare(receiver, plans[1], "r1")
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.run_transfer("r1")
        except BaseException as exc:  # the abort below
            failed.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()  # waits for the sender's bytes, which never come
    deadline = time.monotonic() + 30
    while not receiver._transferring and time.monotonic() < deadline:
        time.sleep(0.01)
    _prepare(receiver, plans[1], "r2")
    assert not _armed(receiver, "r2")
    receiver.on_abort_now(AbortRefitCmd("r1", "CANCELLED", "cancelled"))
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(failed) == 1
    assert "cancelled" in str(failed[0])
