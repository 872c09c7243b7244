"""A pre-armed update (the sidecar sends /update_weights at PrepareRefit) waits in the vLLM
worker for the coordinator's StartTransfer of its refit (`WorkerMember.wait_for_start`):
it goes on once its own StartTransfer arrived (before or while it waits), fails at once,
as not started, when the refit is aborted or the rank leaves its group first, and fails
with the refit and what did not come named after its bound. Through the engine
(`receive_weights`), a refit aborted first is recorded as failed with nothing modified, so
the finish that closes vLLM's session applies nothing and the held version stays."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from refitplane.protocol.messages import AbortRefitCmd, LeaveGroupCmd, StartTransferCmd
from refitplane.reshard.shards import LocalShards

pytestmark = pytest.mark.unit

vllm_engine = pytest.importorskip("refitplane.generator.vllm_engine")
from refitplane.generator.vllm_worker_member import StartNotSeen, WorkerMember  # noqa: E402

# Far beyond what any wait below may take: a release "at once" never comes near it.
LONG_S = 300.0


def _member() -> WorkerMember:
    return WorkerMember(LocalShards(), device=torch.device("cpu"), local_host="127.0.0.1")


def _waiting(member: WorkerMember, refit_id: str) -> tuple[threading.Thread, list[Any]]:
    """`wait_for_start` on a thread of its own (as on vLLM's worker thread); its outcome
    ("started" or the StartNotSeen) lands in the list."""
    outcome: list[Any] = []

    def wait() -> None:
        try:
            member.wait_for_start(refit_id, LONG_S)
            outcome.append("started")
        except StartNotSeen as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, outcome


def _settled(thread: threading.Thread, outcome: list[Any]) -> Any:
    thread.join(timeout=LONG_S / 2)
    assert not thread.is_alive(), "the wait was not released"
    (result,) = outcome
    return result


def test_a_start_that_came_first_goes_on_at_once() -> None:
    member = _member()
    member.on_start_transfer(StartTransferCmd("r1", 1))
    member.wait_for_start("r1", LONG_S)  # returns: the transfer may run


def test_a_start_while_waiting_releases_the_wait() -> None:
    member = _member()
    thread, outcome = _waiting(member, "r1")
    member.on_start_transfer(StartTransferCmd("r0", 1))  # another refit's: keeps waiting
    time.sleep(0.2)
    assert thread.is_alive()
    assert not outcome
    member.on_start_transfer(StartTransferCmd("r1", 1))
    assert _settled(thread, outcome) == "started"


@pytest.mark.parametrize(
    "abort",
    [
        AbortRefitCmd("r1", "CANCELLED", "cancelled by the operator"),
        AbortRefitCmd("", "CANCELLED", "every refit"),
        LeaveGroupCmd(epoch=1, abort=True),
    ],
    ids=["abort", "abort-unnamed", "leave-group"],
)
def test_an_abort_while_waiting_fails_it_at_once_as_not_started(abort: Any) -> None:
    member = _member()
    thread, outcome = _waiting(member, "r1")
    time.sleep(0.2)
    member.on_abort_now(abort)
    exc = _settled(thread, outcome)
    assert isinstance(exc, StartNotSeen)
    assert exc.aborted
    assert not exc.weights_modified
    assert "refit r1 was aborted before its StartTransfer" in exc.message


def test_a_late_leave_group_of_an_older_epoch_does_not_release_the_wait() -> None:
    member = _member()
    member.epoch = 3
    thread, outcome = _waiting(member, "r1")
    member.on_abort_now(LeaveGroupCmd(epoch=2, abort=True))
    time.sleep(0.2)
    assert thread.is_alive()
    assert not outcome
    member.on_start_transfer(StartTransferCmd("r1", 1))
    assert _settled(thread, outcome) == "started"


def test_an_abort_before_the_update_arrives_fails_it_at_once() -> None:
    member = _member()
    member.on_abort_now(AbortRefitCmd("r1", "PREPARE_TIMEOUT", "a trainer did not prepare"))
    with pytest.raises(StartNotSeen) as caught:
        member.wait_for_start("r1", LONG_S)
    assert caught.value.aborted


def test_a_start_that_never_comes_fails_at_the_bound_naming_the_refit() -> None:
    member = _member()
    with pytest.raises(StartNotSeen) as caught:
        member.wait_for_start("r7", 0.2)
    assert not caught.value.aborted
    assert not caught.value.weights_modified
    message = caught.value.message
    assert "refit r7" in message
    assert "StartTransfer did not reach this rank within 0.2 s" in message


def test_an_aborted_prearmed_update_is_recorded_as_failed_and_modifies_nothing() -> None:
    from vllm.config import VllmConfig

    engine = vllm_engine.RefitplaneEngine(
        None, VllmConfig(), torch.device("cpu"), torch.nn.Linear(1, 1)
    )
    # As after a working init; this test asks nothing of the session.
    engine.member, engine.session = _member(), object()
    engine.start_weight_update()
    engine.member.on_abort_now(AbortRefitCmd("r1", "CANCELLED", "cancelled"))
    engine.receive_weights(engine.parse_update_info({"refit_id": "r1", "start_wait_s": LONG_S}))
    (record,) = engine("status")["updates"]
    assert not record["ok"], record
    assert not record["modified"], record
    assert "aborted before its StartTransfer" in record["message"]
    assert engine.member.transfers == 0
    engine.finish_weight_update()
    status = engine("status")
    assert status["last"] == "failed", status
    assert not status["incomplete"], status
    assert status["version"] == 0  # nothing applied: the version held before
