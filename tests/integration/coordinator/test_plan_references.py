"""Plans are sent once: the first PrepareRefit of a plan carries its body, later ones only
name it (digest + rank), a rank that no longer holds a named plan gets it again without the
refit failing, and a changed layout or a new group epoch sends the body again.

Real coordinator (embedded store and Redis), real gRPC agent sessions on loopback, simulated
data plane (`SimulatedAgent` keeps plans in the same `RankPlanCache` data-plane ranks use)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.protocol import RefitState, Role, convert
from refitplane.protocol.messages import PrepareRefitCmd
from tests.integration.conftest import row_layout

pytestmark = pytest.mark.integration

# A layout with enough tensors that a plan's body is large on the wire.
MANY = tuple((f"model.layers.{i}.mlp.down_proj.weight", (16, 8), "bfloat16") for i in range(200))


class WireSizes:
    """Every command the agent sessions of this process decode, with its size on the wire."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prepares: list[tuple[str, int, bool]] = []  # (refit id, bytes, carries a body)
        self._lock = threading.Lock()
        original = convert.command_from_proto

        def recording(raw: Any) -> Any:
            if raw.WhichOneof("command") == "prepare_refit":
                with self._lock:
                    self.prepares.append(
                        (
                            raw.prepare_refit.refit_id,
                            raw.ByteSize(),
                            raw.prepare_refit.HasField("plan"),
                        )
                    )
            return original(raw)

        monkeypatch.setattr(convert, "command_from_proto", recording)

    def of(self, refit_id: str) -> list[tuple[int, bool]]:
        with self._lock:
            return [(size, body) for rid, size, body in self.prepares if rid == refit_id]


def _plans_sent(coord: Any, how: str) -> float:
    value = coord.core.metrics.registry.get_sample_value("refit_rank_plans_total", {"how": how})
    return value or 0.0


def _refit(cluster: Any, **kw: Any) -> Any:
    client = cluster.client()
    refit = client.wait(client.trigger("job", **kw).refit_id, timeout_s=20)
    assert refit.state is RefitState.COMMITTED, (refit.reason, refit.message)
    return refit


def _prepares(member: Any) -> list[PrepareRefitCmd]:
    return [c for c in member.agent.received(PrepareRefitCmd) if isinstance(c, PrepareRefitCmd)]


def test_plan_body_goes_once_then_is_named(
    coordinator_factory, store_url, sim_cluster, monkeypatch
):
    wire = WireSizes(monkeypatch)
    coord = coordinator_factory(redis_url=store_url)
    cluster = sim_cluster(coord)
    trainers = [
        cluster.add(Role.TRAINER, rank=r, world=2, layout=row_layout(r, 2, tensors=MANY))
        for r in range(2)
    ]
    gen = cluster.add(
        Role.GENERATOR, replica="a", layout=row_layout(0, 1, tensors=MANY), device="cpu"
    )

    first, second, third = _refit(cluster), _refit(cluster), _refit(cluster)

    for member in (*trainers, gen):
        cmds = _prepares(member)
        assert len(cmds) == 3
        assert cmds[0].plan is not None
        assert cmds[1].plan is None
        assert cmds[2].plan is None
        assert {c.plan_key for c in cmds} == {(first.plan_digest, cmds[0].plan.rank)}
    # What went over the wire: the whole plan once, a few dozen bytes after that.
    body_sizes = [size for size, body in wire.of(first.refit_id) if body]
    assert len(body_sizes) == 3
    assert min(body_sizes) > 4000
    for refit in (second, third):
        sizes = wire.of(refit.refit_id)
        assert len(sizes) == 3
        assert not any(body for _, body in sizes)
        assert max(size for size, _ in sizes) < 200
    assert _plans_sent(coord, "BODY") == 3
    assert _plans_sent(coord, "REFERENCE") == 6
    assert _plans_sent(coord, "RESENT") == 0
    # Named plans still move every byte and verify every tensor.
    assert third.bytes_done == third.bytes_total == first.bytes_total
    assert third.tensors_verified == third.tensors_total == len(MANY)
    assert gen.agent.plans.hits == 2


def test_a_rank_that_lost_its_plan_gets_it_again(coordinator_factory, store_url, sim_cluster):
    coord = coordinator_factory(redis_url=store_url)
    cluster = sim_cluster(coord)
    trainers = cluster.trainers(world=2)
    gen = cluster.replica("a")[0]
    first = _refit(cluster)

    gen.agent.plans.clear()  # evicted, or state lost under the same member id
    trainers[1].agent.plans.clear()
    second = _refit(cluster)

    assert second.bytes_done == first.bytes_total
    assert second.tensors_verified == second.tensors_total == 2
    for member in (gen, trainers[1]):
        cmds = [c for c in _prepares(member) if c.refit_id == second.refit_id]
        # Named first, answered PlanMissing, then sent with its body.
        assert [c.plan is not None for c in cmds] == [False, True]
    assert [c.plan is not None for c in _prepares(trainers[0])] == [True, False]
    assert _plans_sent(coord, "RESENT") == 2
    # Held again: the next refit only names it.
    third = _refit(cluster)
    assert [c.plan is None for c in _prepares(gen) if c.refit_id == third.refit_id] == [True]


def test_plan_evicted_by_other_plans_is_resent(coordinator, sim_cluster):
    """A rank keeping one plan, serving refits that alternate between two targets: each
    refit names a plan the coordinator saw acknowledged, but the rank evicted it since."""
    cluster = sim_cluster(coordinator)
    trainer = cluster.add(Role.TRAINER, layout=row_layout(0, 1))
    trainer.agent.plans = type(trainer.agent.plans)(capacity=1)
    cluster.replica("a")
    cluster.replica("b")
    refits = [_refit(cluster, target_replicas=targets) for targets in (["a"], ["b"], ["a"])]

    cmds = _prepares(trainer)
    assert len({r.plan_digest for r in refits}) == 2
    assert refits[0].plan_digest == refits[2].plan_digest
    last = [c.plan is not None for c in cmds if c.refit_id == refits[2].refit_id]
    assert last == [False, True]
    assert _plans_sent(coordinator, "RESENT") == 1


def test_changed_layout_or_new_epoch_sends_the_plan_again(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    trainers = cluster.trainers(world=2)
    gen = cluster.replica("a")[0]
    first = _refit(cluster)
    named = _refit(cluster)
    assert [c.plan is None for c in _prepares(gen)] == [False, True]

    # A new group epoch (a failed refit poisons the group), the same layouts and plan.
    trainers[0].agent.behaviour = Behaviour(fail={"start_transfer": ("BOOM", "injected", False)})
    client = cluster.client()
    failed = client.wait(client.trigger("job").refit_id, timeout_s=20)
    assert failed.state is RefitState.FAILED
    trainers[0].agent.behaviour = Behaviour()
    after_epoch = _refit(cluster)
    assert after_epoch.group_epoch > named.group_epoch
    assert after_epoch.plan_digest == first.plan_digest
    cmd = [c for c in _prepares(gen) if c.refit_id == after_epoch.refit_id]
    assert [c.plan is not None for c in cmd] == [True]

    # A changed layout: the trainers now hold the weight by rows of 4 (another plan).
    for r, t in enumerate(trainers):
        t.session.publish_layout(
            row_layout(
                r, 2, tensors=(("model.layers.0.mlp.down_proj.weight", (16, 8), "bfloat16"),)
            )
        )
    gen.session.publish_layout(
        row_layout(0, 1, tensors=(("model.layers.0.mlp.down_proj.weight", (16, 8), "bfloat16"),))
    )
    changed = _refit(cluster)
    assert changed.plan_digest != first.plan_digest
    cmd = [c for c in _prepares(gen) if c.refit_id == changed.refit_id]
    assert [c.plan is not None for c in cmd] == [True]
    assert cmd[0].plan is not None
    assert cmd[0].plan.plan_digest == changed.plan_digest
