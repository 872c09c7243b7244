"""`RefitRun.critical_path`: the member each phase waited for last, per refit (issue 23's
control-time breakdown, logged when a refit commits); `RefitRun.set_hops`: each rank's hop
timeline kept with the record, and the line `testing.hops.hop_line` makes of it."""

from __future__ import annotations

import re

from refitplane.coordinator.core.records import RefitRecord
from refitplane.coordinator.core.run import RefitRun
from refitplane.protocol import RefitState
from refitplane.protocol import messages as msg
from refitplane.protocol.models import PhaseTiming
from refitplane.testing.hops import hop_line


def _enter(run: RefitRun, state: RefitState) -> None:
    run.written(run.record.model_copy(update={"state": state}))


def test_the_last_report_of_each_kind_is_named_with_its_time_into_its_phase() -> None:
    run = RefitRun(RefitRecord(refit_id="r", job="j", version=1))
    _enter(run, RefitState.PREPARING)
    run.reported("Prepared", "trainer-a")
    run.reported("Prepared", "sidecar-b")
    _enter(run, RefitState.TRANSFERRING)
    run.reported("ReplicaUpdated", "sidecar-b")  # before VERIFYING: counted in TRANSFERRING
    run.reported("TransferDone", "worker-c")
    _enter(run, RefitState.VERIFYING)
    run.written(run.record)  # a flush of the same phase does not restart it
    parts = run.critical_path().split("; ")
    assert [p.split(" +")[0] for p in parts] == [
        "Prepared: sidecar-b",
        "ReplicaUpdated: sidecar-b",
        "TransferDone: worker-c",
    ]
    assert [re.sub(r"\+[\d.]+ ms", "+x ms", p).split(" +")[1] for p in parts] == [
        "x ms into PREPARING",
        "x ms into TRANSFERRING",
        "x ms into TRANSFERRING",
    ]


def test_each_ranks_hops_are_kept_with_the_record_and_survive_later_progress() -> None:
    run = RefitRun(RefitRecord(refit_id="r", job="j", version=1))
    run.update(start_sent_ns=1_000_000)
    run.set_progress("trainer-a", sent=8, received=0, total=8)
    run.set_hops(
        "trainer-a", msg.HopStamps(1_500_000, 2_000_000, 12_000_000, 12_250_000), 13_000_000
    )
    run.set_hops(
        "worker-b", msg.HopStamps(3_000_000, 3_500_000, 14_000_000, 15_000_000), 16_000_000
    )
    run.set_progress("trainer-a", sent=8, received=0, total=8, verified=0, tensors=0)
    run.update(transfer_end_ns=16_500_000)
    view = run.record.view()
    trainer = next(r for r in view.ranks if r.member_id == "trainer-a")
    assert (trainer.bytes_sent, trainer.executor_end_ns, trainer.done_recorded_ns) == (
        8,
        12_000_000,
        13_000_000,
    )
    assert hop_line(view, {"trainer-a": "t0", "worker-b": "g0"}) == (
        "hops (t0, g0): coordinator->start seen 0.50/2.00 ms, start->executor 0.50/0.50, "
        "executor 10.00/10.50, executor end->TransferDone sent 0.25/1.00, "
        "sent->recorded 0.75/1.00, last report->phase end 0.50, phase entry->start sent -"
    )
    # With the phase's time: what TRANSFERRING spent before StartTransfer went out.
    timed = view.model_copy(
        update={"timings": [PhaseTiming(phase=RefitState.TRANSFERRING, seconds=0.0175)]}
    )
    assert hop_line(timed).endswith("phase entry->start sent 2.00")


def test_a_record_without_stamps_says_so() -> None:
    view = RefitRecord(refit_id="r", job="j", version=1).view()
    assert hop_line(view).startswith("hops: none stamped")
