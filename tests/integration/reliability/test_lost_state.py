"""Lost state (issue 22 §3), every part a real process: redis-server (AOF), the coordinator
process, one trainer rank and two one-rank generator replicas over Gloo.

Expected:
* Redis wiped mid-life (FLUSHALL): the coordinator notices (its incarnation sentinel is
  gone), answers `/readyz` 503 and gRPC health NOT_SERVING until it re-seeded the store and
  the members registered again (one is frozen meanwhile, so the window is a lease TTL);
  every member registers again with the version it holds; member records are back in
  Redis; the next refit (version chosen by the coordinator) goes above every version the
  replicas hold and commits.
* A terminal reason never changes: a refit that fails (TIMEOUT: a stalled trainer) while
  Redis is away for longer than the driver used to retry is shown terminal only once that
  is persisted, counted once in `refit_failures_total` under that reason (it used to be
  failed a second time, COORDINATOR_RESTARTED, once Redis was back), and reads the same
  after a coordinator restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refitplane.errors import RefitError
from refitplane.protocol import MemberState, RefitState
from refitplane.protocol.models import Refit
from tests.integration.reliability.conftest import LEASE_TTL_S, start_world
from tests.integration.reliability.support import World, note

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Longer than the transfer timeout plus the ~13 s (and the redis-py retries) after which the
# driver used to stop trying to persist the failure: it fails while Redis is away and can
# be persisted only after.
LONG_OUTAGE_S = 35.0


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = start_world(
        tmp_path_factory.mktemp("lost-state"), trainers=1, replicas={"rep-0": 1, "rep-1": 1}
    )
    try:
        yield w
    finally:
        w.cluster.close()


def _redis(world: World) -> redis.Redis:
    assert world.cluster.redis is not None
    return redis.Redis.from_url(world.cluster.redis.url, decode_responses=True)


def _not_serving(channel: grpc.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)


def _commit_above(world: World, held: int) -> int:
    """Trigger a refit of new weights: the coordinator must pick a version above `held` (what
    the replicas hold), commit it, and every replica must then hold those weights."""
    weights = world.next_version()
    world.step(weights)
    with world.cluster.client() as client:
        refit = client.trigger(world.cluster.job)
        assert refit.version > held, (refit.version, held)
        final = client.wait(refit.refit_id, timeout_s=60)
    assert final.state is RefitState.COMMITTED, (final.reason, final.message)
    world.version = refit.version
    world.check_holds(refit.version, weights=weights)
    return refit.version


def test_wiped_store_is_detected_and_reseeded_from_the_members(world: World) -> None:
    cluster = world.cluster
    world.commit()
    held = world.committed
    registrations = _registrations(world)
    frozen = cluster.generators[0]
    frozen.freeze()  # its re-registration waits: the not-ready window lasts a lease TTL
    seen_503 = seen_not_serving = False
    with (
        _redis(world) as r,
        httpx.Client(base_url=cluster.coordinator.http_url, timeout=5) as http,
        grpc.insecure_channel(cluster.coordinator.grpc_target) as channel,
    ):
        r.flushall()
        wiped = time.monotonic()
        deadline = wiped + 2 * LEASE_TTL_S + 10
        while time.monotonic() < deadline and not (seen_503 and seen_not_serving):
            seen_503 |= http.get("/readyz").status_code == 503
            seen_not_serving |= _not_serving(channel)
            time.sleep(0.02)
        detected_s = time.monotonic() - wiped
        frozen.thaw()
        assert seen_503, "/readyz stayed 200 after Redis lost every key"
        assert seen_not_serving, "gRPC health stayed SERVING after Redis lost every key"

        def ready_again() -> bool:
            return http.get("/readyz").status_code == 200

        _wait("/readyz 200 again", ready_again, 30)
        _wait_registered_again(world, registrations, exactly_once=True)
        cluster.wait_ready()
        # Member records are upserted: all of them are back in Redis.
        assert len(r.keys("refit:member:*")) == len(cluster.agents)
        assert int(r.hget(f"refit:job:{cluster.job}", "last_version") or 0) >= held
    # The coordinator picks the next version itself: above what every replica holds.
    next_version = _commit_above(world, held)
    note(
        "test_wiped_store_is_detected_and_reseeded_from_the_members",
        replicas_held=held,
        next_version=next_version,
        not_ready_seen_after_s=detected_s,
    )


def test_coordinator_restarted_on_a_wiped_store_goes_above_held_versions(world: World) -> None:
    """Redis wiped while the coordinator is down: the new one starts on an empty store (to it,
    a first boot), its members come back on their own (NOT_FOUND → register again with the
    version they hold), and the job's next version is still above every held version."""
    cluster = world.cluster
    world.commit()
    held = world.committed
    registrations = _registrations(world)
    cluster.coordinator.kill()
    with _redis(world) as r:
        r.flushall()
    cluster.coordinator.start()
    _wait_registered_again(world, registrations, exactly_once=True)
    cluster.wait_ready()
    for agent in cluster.generators:
        assert agent.status()["version"] == held, agent.name
    next_version = _commit_above(world, held)
    note(
        "test_coordinator_restarted_on_a_wiped_store_goes_above_held_versions",
        replicas_held=held,
        next_version=next_version,
    )


def test_wipe_mid_refit_fails_it_with_a_record(world: World) -> None:
    """FLUSHALL while a refit transfers: the refit does not vanish — it is written back and
    FAILED STORE_STATE_LOST (participants released); the next refit commits above it."""
    cluster = world.cluster
    version = world.next_version()
    world.step(version)
    cluster.trainers[0].arm(delay_s=2.0)
    refit = world.trigger(version)
    cluster.wait_state(refit.refit_id, RefitState.TRANSFERRING)
    with _redis(world) as r:
        r.flushall()
    final = cluster.wait(refit.refit_id, timeout_s=60)
    assert final.state is RefitState.FAILED, final
    assert final.reason == "STORE_STATE_LOST", (final.reason, final.message)
    with httpx.Client(base_url=cluster.coordinator.http_url, timeout=5) as http:
        _wait("/readyz 200 again", lambda: http.get("/readyz").status_code == 200, 30)
    world.check_released(final)
    cluster.wait_ready()
    committed = world.commit()
    assert committed.version > final.version
    note("test_wipe_mid_refit_fails_it_with_a_record", reason=final.reason)


def test_an_idempotency_key_survives_a_wiped_store(world: World) -> None:
    """A key used before Redis was wiped still names the refit it created: the coordinator
    writes the keys it handed out back when it re-seeds the store (on main the same key
    created a second refit)."""
    cluster = world.cluster
    version = world.next_version()
    world.step(version)
    key = f"step-{version}-{time.time_ns()}"
    first = world.trigger(version, idempotency_key=key)
    done = cluster.wait(first.refit_id, timeout_s=60)
    assert done.state is RefitState.COMMITTED, (done.reason, done.message)
    world.check_holds(version)
    registrations = _registrations(world)
    with _redis(world) as r:
        r.flushall()
    # The wipe was detected: every member came back.
    _wait_registered_again(world, registrations, exactly_once=False)
    with httpx.Client(base_url=cluster.coordinator.http_url, timeout=5) as http:
        _wait("/readyz 200 again", lambda: http.get("/readyz").status_code == 200, 30)
    cluster.wait_ready()
    with cluster.client() as client:
        again = client.trigger(cluster.job, idempotency_key=key)
        assert again.refit_id == first.refit_id, (again.refit_id, first.refit_id)
        assert (again.state, again.version) == (RefitState.COMMITTED, version)
        assert client.get(first.refit_id).state is RefitState.COMMITTED
        assert [r.refit_id for r in client.list(cluster.job)] == [first.refit_id]
    # A new key still makes a new refit, above every version used.
    committed = world.commit()
    assert committed.version > version
    note("test_an_idempotency_key_survives_a_wiped_store", refit=first.refit_id[:8])


def _registrations(world: World) -> dict[str, int]:
    """How many times each agent of the cluster has registered so far."""
    return {a.name: a.status()["registrations"] for a in world.cluster.agents.values()}


def _wait_registered_again(world: World, before: dict[str, int], *, exactly_once: bool) -> None:
    """Every agent registers again after `before` was read: once (`exactly_once`: a wipe
    the coordinator saw once), or at least once."""
    for agent in world.cluster.agents.values():
        _wait(
            f"{agent.name} to register again",
            lambda a=agent: (
                a.status()["registrations"] == before[a.name] + 1
                if exactly_once
                else a.status()["registrations"] > before[a.name]
            ),
            30,
        )


def _wait(what: str, predicate: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except (RefitError, httpx.HTTPError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _failures(world: World) -> dict[str, float]:
    """refit_failures_total by reason, from the coordinator's /metrics."""
    text = httpx.get(f"{world.cluster.coordinator.http_url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("refit_failures_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def test_a_terminal_reason_never_changes(world: World) -> None:
    cluster = world.cluster
    assert cluster.redis is not None
    failures_before = _failures(world)
    version = world.next_version()
    world.step(version)
    cluster.trainers[0].arm(stall_after_bytes=0, stall_until="abort")
    refit = world.trigger(version)
    cluster.wait_state(refit.refit_id, RefitState.TRANSFERRING)
    seen: list[Refit] = []
    stop = threading.Event()

    def watch() -> None:
        """What a client polling GetRefit sees, through the outage."""
        with cluster.client(timeout_s=2) as client:
            while not stop.is_set():
                try:
                    record = client.get(refit.refit_id)
                except RefitError:
                    time.sleep(0.05)
                    continue
                seen.append(record)
                if record.state.terminal:
                    return
                time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cluster.redis.kill()
    time.sleep(LONG_OUTAGE_S)
    cluster.redis.start()
    final = cluster.wait(refit.refit_id, timeout_s=90)
    stop.set()
    watcher.join(timeout=10)
    terminal = [r for r in seen if r.state.terminal]
    assert final.state is RefitState.FAILED, final
    assert {(r.state, r.reason) for r in terminal} <= {(final.state, final.reason)}, (
        [(r.state, r.reason) for r in terminal],
        final.reason,
    )
    failures = _failures(world)
    counted = {
        reason: n - failures_before.get(reason, 0.0)
        for reason, n in failures.items()
        if n != failures_before.get(reason, 0.0)
    }
    assert counted == {final.reason: 1.0}, counted
    # Across a coordinator restart too.
    cluster.coordinator.kill()
    cluster.coordinator.start()
    with cluster.client() as client:
        again = client.get(refit.refit_id)
    assert (again.state, again.reason) == (final.state, final.reason)
    world.check_released(final)
    world.commit()
    note("test_a_terminal_reason_never_changes", reason=final.reason, polls=len(seen))


# After the trigger, when the coordinator is SIGKILLed: PENDING/PREPARING through the
# transfer (held back 0.4 s by the trainer) to after the commit.
KILL_AFTER_S = (0.0, 0.1, 0.2, 0.3, 0.4, 1.5)


def _mismatch(world: World) -> str:
    """The kill -9 rule, broken ('' when it holds): a replica whose ranks all serve one
    version V must be shown READY at V, one with a rank that cannot serve DEGRADED; ranks
    that serve hold exactly V's bytes."""
    cluster = world.cluster
    shown = {r.replica_id: r for r in cluster.topology().replicas}
    ranks: dict[str, list[dict[str, Any]]] = {}
    for agent in cluster.generators:
        status = agent.status()
        if status["ready"] and status["digests"] != world.held(status):
            return f"{agent.name} is ready at {status['version']} with other bytes"
        ranks.setdefault(str(status["replica"]), []).append(status)
    for replica, statuses in ranks.items():
        versions = {s["version"] for s in statuses}
        serving = all(s["ready"] for s in statuses) and len(versions) == 1
        rep = shown[replica]
        held = [(s["version"], s["ready"]) for s in statuses]
        if serving and (rep.state is not MemberState.READY or rep.version not in versions):
            return f"{replica}: ranks hold {held}, shown {rep.state.value} at {rep.version}"
        if not serving and rep.state is not MemberState.DEGRADED:
            return f"{replica}: ranks hold {held}, shown {rep.state.value} at {rep.version}"
    return ""


def test_kill_9_mid_refit_shows_what_replicas_hold(world: World) -> None:
    cluster = world.cluster
    landed: list[str] = []
    for offset in KILL_AFTER_S:
        version = world.next_version()
        world.step(version)
        cluster.trainers[0].arm(delay_s=0.4)
        refit = world.trigger(version)
        time.sleep(offset)
        cluster.coordinator.kill()
        cluster.coordinator.start()
        final = cluster.wait(refit.refit_id, timeout_s=60)
        assert final.state is RefitState.COMMITTED or final.reason == "COORDINATOR_RESTARTED", (
            final.state,
            final.reason,
        )
        landed.append(final.message.rsplit(" ", 1)[-1] if final.reason else final.state.value)
        if landed[-1] in ("TRANSFERRING", "VERIFYING", "COMMITTED"):
            for agent in cluster.agents.values():  # their transfers ended
                cluster.wait_outcome(agent, refit.refit_id, timeout_s=30)
        deadline = time.monotonic() + 20
        while (problem := _mismatch(world)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not problem, f"kill {offset} s after the trigger ({landed[-1]}): {problem}"
        world.commit()
    note("test_kill_9_mid_refit_shows_what_replicas_hold", kill_after_s=KILL_AFTER_S,
         landed=landed)  # fmt: skip


def test_kill_9_during_preparing_shows_what_replicas_hold(world: World) -> None:
    """Held in PREPARING (one generator frozen, so it cannot report Prepared while the
    others have paused serving for the refit), the coordinator is SIGKILLed and restarted:
    the refit ends FAILED COORDINATOR_RESTARTED naming PREPARING, its participants are
    released (the paused ranks serve again), every replica is shown at the version its
    ranks hold, and the next refit commits."""
    cluster = world.cluster
    held = world.committed
    version = world.next_version()
    world.step(version)
    frozen = cluster.generators[0]
    frozen.freeze()
    try:
        refit = world.trigger(version)
        cluster.wait_state(refit.refit_id, RefitState.PREPARING)
        cluster.coordinator.kill()
        cluster.coordinator.start()
    finally:
        frozen.thaw()
    final = cluster.wait(refit.refit_id, timeout_s=60)
    # Only the kill ends a refit held in PREPARING with this reason (else: TIMEOUT).
    assert final.state is RefitState.FAILED, final
    assert final.reason == "COORDINATOR_RESTARTED", (final.reason, final.message)
    assert final.message.endswith("PREPARING"), final.message
    world.check_released(final)
    deadline = time.monotonic() + 20
    while (problem := _mismatch(world)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not problem, f"kill during PREPARING: {problem}"
    for agent in cluster.generators:
        assert agent.status()["version"] == held, agent.name
    committed = world.commit()
    assert committed.version > version
    note("test_kill_9_during_preparing_shows_what_replicas_hold", message=final.message)
