"""The replica controller's update pre-armed at PrepareRefit (docs/generator.md, "The
update, pre-armed"), against a real coordinator (simulated ranks): a refit cancelled in
PREPARING (a generator rank that never prepares) after the controller pre-armed the update
never reaches its StartTransfer there,
so the controller cannot know from its own steps whether the workers began (their own
StartTransfer may have come). Its AbortRefit waits for the pre-armed answer, closes the
update (discard, then finish), and asks the workers: none touched its weights, the engine
resumes and the replica stays ready; one reports incomplete weights, or none can be asked
(ranks whose receive mode touches live weights), and the replica stays paused, not ready."""

from __future__ import annotations

from typing import Any

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.client import RefitClient
from refitplane.protocol import Role
from refitplane.replica.controller import SidecarMember
from tests.integration.conftest import row_layout, wait_until
from tests.integration.generator.test_sidecar_sleep import SleepyEngine

pytestmark = pytest.mark.integration


class _AwakeEngine(SleepyEngine):
    """An awake engine whose workers' status is `statuses` (None: no status channel)."""

    def __init__(self, statuses: list[dict[str, Any]] | None) -> None:
        super().__init__(level=0)
        self.resident = {"weights": True, "kv_cache": True}
        self.paused = False
        self.statuses = statuses

    def engine_status(self, timeout_s: float = 30.0) -> list[dict[str, Any]] | None:
        self.calls.append("status")
        return self.statuses


@pytest.mark.parametrize(
    ("statuses", "touched"),
    [
        ([{"rank": 0, "incomplete": False}], False),
        ([{"rank": 0, "incomplete": True}], True),
        (None, True),
    ],
    ids=["untouched", "incomplete", "unreadable"],
)
def test_an_abort_before_start_asks_the_workers_what_the_prearmed_update_did(
    coordinator, sim_cluster, statuses, touched
):
    cluster = sim_cluster(coordinator)
    cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    never_prepares = Behaviour(silent=frozenset({"prepare_refit"}))
    cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1), behaviour=never_prepares)
    engine = _AwakeEngine(statuses)
    client = RefitClient(coordinator.grpc_target)
    member = SidecarMember(
        engine, client, job="job", replica_id="a", default_pause_mode="keep", prearm_wait_s=60.0
    )
    session = member.connect(coordinator.grpc_target, host="127.0.0.1", token=None, tls_ca=None)
    session.start()
    try:
        refit_id = client.trigger("job").refit_id
        wait_until(lambda: member.prearmed_refit == refit_id, what="the update pre-armed")
        client.cancel(refit_id)
        refit = client.wait(refit_id, timeout_s=30)
        assert refit.state.value == "CANCELLED", refit
        wait_until(lambda: not member.state.update_open, what="the update closed")
        # Pre-armed at PrepareRefit, then closed: its answer, discard, finish, the workers.
        assert engine.calls[:4] == ["pause", "start_update", "update", "discard"], engine.calls
        assert engine.calls[4:6] == ["finish", "status"], engine.calls
        if touched:
            wait_until(lambda: member.state.degraded, what="the replica not ready")
            assert member.state.paused
            assert "resume" not in engine.calls
        else:
            wait_until(lambda: not member.state.paused, what="the engine resumed")
            assert engine.calls[-1] == "resume"
            assert not member.state.degraded
        assert member.prearmed_refit == ""
    finally:
        member.close()
        session.close()
        client.close()
