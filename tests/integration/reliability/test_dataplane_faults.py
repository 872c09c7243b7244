"""Faults in the data plane, with every part a real process: redis-server, the coordinator,
two trainer ranks (TP2) and two generator replicas (rep-0: TP2, rep-1: TP1) moving bytes over
Gloo. Faults are injected in the agents' real transport (`refitplane.testing.cluster.faulty_transport`)
or by signals (SIGKILL, SIGSTOP) from the test.

For every fault: the refit ends FAILED with a reason within the configured timeout; every
surviving rank is released; no generator serves or reports a version it does not fully hold
(see `support.World.policies`); the next refit forms a new group epoch (the failed epoch's
communicators aborted, new ones built) and commits, every generator then holding exactly the
trainers' bytes.

Which generator policy applies: a failure before a rank posted any receive (PREPARING,
a cancel before the transfer) leaves its weights intact and it keeps serving its previous
version; once it posted one (bytes land as they arrive), a failed transfer leaves it not
ready until a later refit commits on it.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from refitplane.protocol import MemberState, RefitState
from refitplane.testing.cluster.processes import wait_for
from tests.integration.reliability.conftest import (
    LEASE_TTL_S,
    PREPARE_TIMEOUT_S,
    SLACK_S,
    TRANSFER_TIMEOUT_S,
)
from tests.integration.reliability.support import COMPLETE, INTACT, NOT_READY, World, note

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _fail_with_stall(world: World, victim: str, *, after_bytes: int = 1, until: str = "deadline"):
    """Step the trainers, arm a stall on `victim`, trigger; returns (version, refit)."""
    version = world.next_version()
    world.step(version)
    world.cluster.agents[victim].arm(stall_after_bytes=after_bytes, stall_until=until)
    refit = world.trigger(version)
    world.wait_stalled(world.cluster.agents[victim])
    return version, refit


def test_generator_killed_mid_transfer(world: World) -> None:
    cluster = world.cluster
    before = world.transports()
    _, refit = _fail_with_stall(world, "rep-1-0")
    victim = cluster.agents["rep-1-0"]
    victim_id = victim.status()["member_id"]
    killed = time.monotonic()
    victim.kill()

    final = cluster.wait(refit.refit_id, timeout_s=TRANSFER_TIMEOUT_S + 3 * SLACK_S)
    assert final.state is RefitState.FAILED
    # Its peers see the connection drop (PEER_FAILED) or its lease runs out, whichever first.
    assert final.reason in {"PEER_FAILED", "LEASE_EXPIRED"}, (final.reason, final.message)
    if final.reason == "LEASE_EXPIRED":
        assert victim_id in final.message
    failed_after = time.monotonic() - killed
    assert failed_after < max(TRANSFER_TIMEOUT_S, LEASE_TTL_S) + SLACK_S
    world.check_released(final)
    policies = world.policies(final)
    assert set(policies.values()) <= {NOT_READY, COMPLETE}
    topo = {r.replica_id: r for r in cluster.topology().replicas}
    assert topo["rep-1"].state in {MemberState.LOST, MemberState.DEGRADED}, topo["rep-1"]

    # The generator's pod comes back from its original checkpoint (version 0).
    cluster.restart_agent("rep-1-0")
    cluster.wait_ready()
    recovery = world.commit()
    assert recovery.group_epoch > final.group_epoch
    world.check_rebuilt(before)
    note("generator killed", reason=final.reason, failed_after_s=failed_after,
         policies=policies, epochs=f"{final.group_epoch}->{recovery.group_epoch}")  # fmt: skip


def test_trainer_killed_mid_transfer(world: World) -> None:
    cluster = world.cluster
    before = world.transports()
    _, refit = _fail_with_stall(world, "trainer-1")
    killed = time.monotonic()
    cluster.agents["trainer-1"].kill()

    final = cluster.wait(refit.refit_id, timeout_s=TRANSFER_TIMEOUT_S + 3 * SLACK_S)
    assert final.state is RefitState.FAILED
    assert final.reason in {"PEER_FAILED", "LEASE_EXPIRED"}, (final.reason, final.message)
    failed_after = time.monotonic() - killed
    assert failed_after < max(TRANSFER_TIMEOUT_S, LEASE_TTL_S) + SLACK_S
    world.check_released(final)
    # Every generator rank had posted its receives: unless its whole share came from
    # trainer 0 and verified, none may serve what it holds now.
    policies = world.policies(final)
    assert set(policies.values()) <= {NOT_READY, COMPLETE}
    assert policies["rep-1-0"] == NOT_READY  # TP1: needs trainer 1's rows
    assert all(r.state is MemberState.DEGRADED for r in cluster.topology().replicas)

    # The trainer rank restarts from the checkpoint of the step it was at.
    cluster.restart_agent("trainer-1", version=world.trainer_weights)
    cluster.wait_ready()
    recovery = world.commit()
    assert recovery.group_epoch > final.group_epoch
    world.check_rebuilt(before)
    note("trainer killed", reason=final.reason, failed_after_s=failed_after,
         policies=policies, epochs=f"{final.group_epoch}->{recovery.group_epoch}")  # fmt: skip


def test_stalled_receiver_fails_the_refit_at_the_transfer_timeout(world: World) -> None:
    """rep-0 rank 1 stops reading (a hung rank that ignores aborts); nobody is killed."""
    cluster = world.cluster
    before = world.transports()
    started = time.monotonic()
    _, refit = _fail_with_stall(world, "rep-0-1", until="deadline")

    final = cluster.wait(refit.refit_id, timeout_s=TRANSFER_TIMEOUT_S + 3 * SLACK_S)
    elapsed = time.monotonic() - started
    assert final.state is RefitState.FAILED
    assert final.reason == "TIMEOUT", (final.reason, final.message)
    assert TRANSFER_TIMEOUT_S - 0.5 <= elapsed <= TRANSFER_TIMEOUT_S + SLACK_S, elapsed
    # The hung rank frees itself at its own transfer deadline: no wait is unbounded.
    stalled = cluster.agents["rep-0-1"]
    cluster.wait_outcome(stalled, refit.refit_id, timeout_s=TRANSFER_TIMEOUT_S + SLACK_S)
    world.check_released(final)
    policies = world.policies(final)
    assert policies["rep-0-1"] == NOT_READY

    recovery = world.commit()  # the same processes, a new epoch
    assert recovery.group_epoch > final.group_epoch
    world.check_rebuilt(before)
    note("receiver stalled", reason=final.reason, failed_after_s=elapsed, policies=policies,
         epochs=f"{final.group_epoch}->{recovery.group_epoch}")  # fmt: skip


def test_checksum_mismatch_fails_the_refit(world: World) -> None:
    """trainer 0 sends one message whose bytes no longer match the checksum it took."""
    cluster = world.cluster
    version = world.next_version()
    world.step(version)
    cluster.agents["trainer-0"].arm(corrupt_sends=1)
    final = cluster.wait(world.trigger(version).refit_id, timeout_s=TRANSFER_TIMEOUT_S + SLACK_S)
    assert cluster.agents["trainer-0"].status()["faults"]["corrupted_sends"] == 1
    assert final.state is RefitState.FAILED
    assert final.reason == "CHECKSUM_MISMATCH", (final.reason, final.message)
    assert "do not match the sender's checksum" in final.message
    assert "from rank 0" in final.message
    world.check_released(final)
    policies = world.policies(final)
    assert NOT_READY in policies.values()  # the rank that got the bad bytes never serves them
    recovery = world.commit()
    assert recovery.group_epoch > final.group_epoch
    note("checksum mismatch", reason=final.reason, policies=policies)


def test_slow_rank_still_commits(world: World) -> None:
    """A rank posting its sends 1.5 s late makes its peers wait; that is not a failure
    (Gloo closes connections on timed-out waits: the transport must not poll with them)."""
    world.cluster.agents["trainer-1"].arm(delay_s=1.5)
    started = time.monotonic()
    final = world.commit()
    assert final.state is RefitState.COMMITTED
    assert world.cluster.agents["trainer-1"].status()["faults"]["delays"] == 1
    note("slow rank", state=final.state.value, refit_s=time.monotonic() - started)


def test_failure_before_any_receive_keeps_weights_intact(world: World) -> None:
    """trainer 1's optimizer step outlasts REFIT_PREPARE_TIMEOUT_S: the refit fails in
    PREPARING, before any generator posted a receive; generators keep serving the previous
    version, byte for byte, and are never marked degraded."""
    cluster = world.cluster
    version = world.next_version()
    cluster.agents["trainer-0"].step(version)
    slow = cluster.agents["trainer-1"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(slow.step, version, 30.0, PREPARE_TIMEOUT_S + 2)
        wait_for("the slow step to hold the weights", lambda: slow.status()["step"] == version, 10)
        world.trainer_weights = version
        started = time.monotonic()
        final = cluster.wait(world.trigger(version).refit_id, timeout_s=PREPARE_TIMEOUT_S + 10)
        elapsed = time.monotonic() - started
        assert final.state is RefitState.FAILED
        assert final.reason == "TIMEOUT", (final.reason, final.message)
        assert "PREPARING" in final.message
        assert "trainer rank 1" in final.message
        assert PREPARE_TIMEOUT_S - 0.5 <= elapsed <= PREPARE_TIMEOUT_S + SLACK_S
        # While the slow step still holds trainer 1, the generators serve their old weights.
        policies = world.policies(final)
        assert set(policies.values()) == {INTACT}
        assert all(r.state is MemberState.READY for r in cluster.topology().replicas)
        assert step.result(timeout=30).status_code == 200
    world.check_released(final)
    world.commit()
    note("prepare timeout", reason=final.reason, failed_after_s=elapsed, policies=policies)


def test_cancel_mid_transfer_releases_everyone(world: World) -> None:
    cluster = world.cluster
    version = world.next_version()
    world.step(version)
    for name in ("trainer-0", "trainer-1"):
        cluster.agents[name].arm(stall_after_bytes=0, stall_until="abort")
    posted_before = {g.name: g.status()["faults"]["bytes_posted"] for g in cluster.generators}
    refit = world.trigger(version)
    cluster.wait_state(refit.refit_id, RefitState.TRANSFERRING)
    world.wait_stalled(cluster.agents["trainer-0"])
    # Cancel once every generator rank has posted receives (a rank still starting its run
    # when the abort comes posts none, and rightly reports its weights intact).
    for g in cluster.generators:
        wait_for(
            f"{g.name} to post receives",
            lambda g=g: g.status()["faults"]["bytes_posted"] > posted_before[g.name],
            30,
        )
    cancelled = time.monotonic()
    # Over REST, as an operator would.
    response = httpx.post(f"{cluster.coordinator.http_url}/v1/refits/{refit.refit_id}/cancel")
    assert response.status_code == 200, response.text
    final = cluster.wait(refit.refit_id, timeout_s=10)
    assert final.state is RefitState.CANCELLED
    assert final.reason == "CANCELLED"
    for agent in world.live_agents():
        cluster.wait_outcome(agent, refit.refit_id, timeout_s=5)
    released_after = time.monotonic() - cancelled
    assert released_after < 5, "the abort did not reach every rank at once"
    world.check_released(final)
    # Receives were posted (nothing arrived, but bytes could have): not ready until a commit.
    policies = world.policies(final)
    assert set(policies.values()) == {NOT_READY}
    world.commit()
    note("cancel", state=final.state.value, all_released_after_s=released_after, policies=policies)


def test_frozen_generator_loses_its_lease_and_comes_back(world: World) -> None:
    """SIGSTOP mid-transfer (a long pause or a partition): its lease expires, the refit
    fails naming it; once thawed, the agent registers again by itself and the next refit
    commits with it."""
    cluster = world.cluster
    frozen = cluster.agents["rep-0-0"]
    old_id = frozen.status()["member_id"]
    _, refit = _fail_with_stall(world, "rep-0-0", until="deadline")
    frozen.freeze()
    started = time.monotonic()
    try:
        final = cluster.wait(refit.refit_id, timeout_s=LEASE_TTL_S + 2 * SLACK_S)
        assert final.state is RefitState.FAILED
        assert final.reason == "LEASE_EXPIRED", (final.reason, final.message)
        assert old_id in final.message
        assert "lease expired" in final.message
        failed_after = time.monotonic() - started
        assert failed_after < LEASE_TTL_S + SLACK_S
        members = {m.member_id: m for m in cluster.topology().members}
        assert members[old_id].state is MemberState.LOST
    finally:
        frozen.thaw()
    wait_for("re-registration", lambda: frozen.status()["registrations"] == 2, 20)
    assert frozen.status()["member_id"] != old_id
    cluster.wait_ready()
    world.check_released(final)
    policies = world.policies(final)
    recovery = world.commit()
    note("generator frozen", reason=final.reason, failed_after_s=failed_after, policies=policies,
         epochs=f"{final.group_epoch}->{recovery.group_epoch}")  # fmt: skip


def test_duplicate_and_concurrent_triggers(world: World) -> None:
    """Twenty triggers of one idempotency key (gRPC and REST at once) make one refit; while
    it runs (held by a slow trainer), ten more with their own keys coalesce into one pending
    refit at the latest version; both commit."""
    cluster = world.cluster
    version = world.next_version()
    world.step(version)
    # Held until released below, not for a fixed time: under load the twenty triggers alone
    # outlasted a 2 s delay and the refit committed before the test saw it transferring.
    held = cluster.agents["trainer-0"]
    held.arm(hold=True)
    world.weights_of[version] = version
    url = f"{cluster.coordinator.http_url}/v1/jobs/{cluster.job}/refits"

    def by_grpc(_: int) -> str:
        return cluster.trigger(version, idempotency_key=f"step-{version}").refit_id

    def by_rest(_: int) -> str:
        body = {"idempotency_key": f"step-{version}", "version": version}
        response = httpx.post(url, json=body, timeout=10)
        assert response.status_code == 202, response.text
        return str(response.json()["refit_id"])

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        ids = {f.result() for f in [pool.submit(by_grpc, i) for i in range(10)]} | {
            f.result() for f in [pool.submit(by_rest, i) for i in range(10)]
        }
        assert len(ids) == 1, ids
        first = ids.pop()
        cluster.wait_state(first, RefitState.TRANSFERRING)
        # Version 0: "the next one" (explicit versions racing each other could arrive out of
        # order, and a version must exceed every version used).
        later = [
            f.result()
            for f in [
                pool.submit(lambda i: cluster.trigger(0, idempotency_key=f"k{version}-{i}"), i)
                for i in range(10)
            ]
        ]
    pending = {r.refit_id for r in later}
    assert len(pending) == 1
    assert first not in pending
    queued = pending.pop()
    latest = max(r.version for r in later)
    assert sorted(r.version for r in later)[0] == version + 1
    world.version = latest
    world.weights_of[latest] = version
    with cluster.client() as client:
        record = client.get(queued)
        assert record.state in {RefitState.PENDING, RefitState.PREPARING}
        assert record.version == latest
        assert record.coalesced == len(later) - 1
    held.release()
    assert cluster.wait(first).state is RefitState.COMMITTED
    done = cluster.wait(queued)
    assert done.state is RefitState.COMMITTED, (done.reason, done.message)
    # The trainers did not step in between: the coalesced version carries their bytes.
    world.check_holds(latest, weights=version)
    with cluster.client() as client:
        assert [r.refit_id for r in client.list(cluster.job, limit=2)] == [queued, first]
    note("triggers", same_key_calls=20, refits=1, while_busy=len(later), coalesced_into=1,
         version=latest)  # fmt: skip
