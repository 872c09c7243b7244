"""`RefitRun.critical_path`: the member each phase waited for last, per refit (issue 23's
control-time breakdown, logged when a refit commits)."""

from __future__ import annotations

import re

from refitplane.coordinator.core.records import RefitRecord
from refitplane.coordinator.core.run import RefitRun
from refitplane.protocol import RefitState


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
