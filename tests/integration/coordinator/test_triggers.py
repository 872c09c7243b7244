"""Triggers: idempotency, coalescing, monotonic versions, cancel, unknown jobs, rate limits."""

from __future__ import annotations

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.errors import FailedPrecondition, InvalidArgument, NotFound, RateLimited
from refitplane.protocol import MemberState, RefitState
from refitplane.protocol.messages import AbortRefitCmd
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def _cluster(sim_cluster, coord, *, hold_s: float = 0.0):
    cluster = sim_cluster(coord)
    cluster.trainers(world=1, behaviour=Behaviour(hold_transfer_s=hold_s))
    cluster.replica("a")
    return cluster


def test_fifty_concurrent_triggers_with_one_key_make_one_refit(
    store_url, coordinator_factory, sim_cluster, executor
):
    cluster = _cluster(sim_cluster, coordinator_factory(store_url))
    client = cluster.client()
    results = list(
        executor.map(lambda _: client.trigger("job", idempotency_key="step-7"), range(50))
    )
    assert len({r.refit_id for r in results}) == 1
    assert {r.version for r in results} == {1}
    assert client.wait(results[0].refit_id, timeout_s=15).state is RefitState.COMMITTED
    assert len(client.list("job")) == 1
    # The key keeps naming that refit after it finished.
    assert client.trigger("job", idempotency_key="step-7").refit_id == results[0].refit_id


def test_triggers_while_busy_coalesce_into_one_pending_refit(
    store_url, coordinator_factory, sim_cluster, executor
):
    # The first refit holds its transfer (bounded) until the triggers are in.
    cluster = _cluster(sim_cluster, coordinator_factory(store_url), hold_s=30)
    client = cluster.client()
    first = client.trigger("job", idempotency_key="k-0")
    wait_until(lambda: client.get(first.refit_id).state is RefitState.TRANSFERRING, what="transfer")
    results = list(
        executor.map(lambda i: client.trigger("job", idempotency_key=f"k-{i + 1}"), range(49))
    )
    pending_ids = {r.refit_id for r in results}
    assert len(pending_ids) == 1
    assert first.refit_id not in pending_ids
    pending = client.get(pending_ids.pop())
    assert pending.state is RefitState.PENDING
    assert pending.coalesced == 48
    # Latest version wins; every version was handed out once.
    assert pending.version == 50
    assert sorted(r.version for r in results) == list(range(2, 51))
    # Release the held transfer: the first refit completes, then the coalesced one.
    for m in cluster.members:
        m.agent.behaviour = Behaviour()
    client.cancel(first.refit_id)
    final = client.wait(pending.refit_id, timeout_s=20)
    assert final.state is RefitState.COMMITTED
    assert final.version == 50
    refits = client.list("job")
    assert [(r.version, r.state) for r in refits] == [
        (50, RefitState.COMMITTED),
        (1, RefitState.CANCELLED),
    ]
    assert client.topology("job").committed_version == 50
    # A later trigger goes above every version used.
    assert client.trigger("job").version == 51


def test_explicit_versions_must_increase(coordinator, sim_cluster):
    client = _cluster(sim_cluster, coordinator).client()
    assert client.trigger("job", version=10).version == 10
    with pytest.raises(FailedPrecondition) as err:
        client.trigger("job", version=10)
    assert err.value.field == "version"
    assert "10" in err.value.message
    assert client.trigger("job").version == 11
    with pytest.raises(InvalidArgument) as err:
        client.trigger("job", version=10**15)
    assert err.value.field == "version"


def test_cancel_running_refit_aborts_participants(store_url, coordinator_factory, sim_cluster):
    cluster = _cluster(sim_cluster, coordinator_factory(store_url), hold_s=30)
    client = cluster.client()
    refit = client.trigger("job")
    wait_until(lambda: client.get(refit.refit_id).state is RefitState.TRANSFERRING, what="transfer")
    cancelled = client.cancel(refit.refit_id)
    assert cancelled.state is RefitState.CANCELLED
    assert cancelled.reason == "CANCELLED"
    for m in cluster.members:
        wait_until(lambda m=m: m.agent.received(AbortRefitCmd), what="abort")
    # Cancelled after StartTransfer: the replica may hold partial weights.
    assert client.topology("job").replicas[0].state is MemberState.DEGRADED
    with pytest.raises(FailedPrecondition):
        client.cancel(refit.refit_id)


def test_cancel_pending_refit(coordinator, sim_cluster):
    cluster = _cluster(sim_cluster, coordinator, hold_s=30)
    client = cluster.client()
    first = client.trigger("job")
    second = client.trigger("job")
    assert second.refit_id != first.refit_id
    cancelled = client.cancel(second.refit_id)
    assert cancelled.state is RefitState.CANCELLED
    # A new trigger after the cancel queues a fresh pending refit.
    third = client.trigger("job")
    assert third.refit_id not in (first.refit_id, second.refit_id)
    assert third.coalesced == 0
    for m in cluster.members:
        m.agent.behaviour = Behaviour()
    client.cancel(first.refit_id)
    assert client.wait(third.refit_id, timeout_s=15).state is RefitState.COMMITTED


def test_unknown_and_allowed_jobs(coordinator_factory, sim_cluster):
    open_coord = coordinator_factory()
    client = _cluster(sim_cluster, open_coord).client()
    with pytest.raises(NotFound) as err:
        client.trigger("nobody-here")
    assert err.value.field == "job"
    with pytest.raises(NotFound) as err:
        client.trigger("job", target_replicas=["zz"])
    assert err.value.field == "target_replicas"
    with pytest.raises(InvalidArgument) as err:
        client.trigger("bad job name")
    assert err.value.field == "job"

    strict = coordinator_factory(allowed_jobs="job,planned")
    cluster = sim_cluster(strict, job="other")
    with pytest.raises(NotFound) as err:
        cluster.trainers(world=1)
    assert err.value.field == "job"
    planned = cluster.client().trigger("planned")
    failed = cluster.client().wait(planned.refit_id, timeout_s=10)
    assert failed.reason == "MEMBERS_MISSING"


def test_trigger_rate_limit(coordinator_factory, sim_cluster):
    client = _cluster(sim_cluster, coordinator_factory(trigger_rate_per_s=2)).client()
    client.trigger("job")
    client.trigger("job")
    with pytest.raises(RateLimited) as err:
        client.trigger("job")
    assert err.value.field == "job"
