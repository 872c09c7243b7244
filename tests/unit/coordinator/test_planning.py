"""Group-rank numbering, target selection, backends and the plan cache."""

from __future__ import annotations

import uuid

import pytest

from refitplane.coordinator.core.failures import RefitFailed
from refitplane.coordinator.core.planning import LayoutCache, PlanCache, Roster
from refitplane.coordinator.core.records import MemberRecord
from refitplane.coordinator.store.embedded import EmbeddedStore
from refitplane.protocol import Backend, MemberState, Role
from refitplane.reshard.layout import LayoutBuilder, TensorSpec

pytestmark = pytest.mark.unit

SPEC = TensorSpec.create("w", (8, 4), "float32")


def _layout(rank, rows):
    b = LayoutBuilder()
    b.add(SPEC, rank, (rows, (0, 4)))
    return b.build()


def _m(
    role,
    rank=0,
    world=1,
    replica="",
    digest="d",
    device="cpu",
    state=MemberState.READY,
    node="",
    gpu="",
):
    return MemberRecord(
        member_id=uuid.uuid4().hex,
        job="j",
        role=role,
        rank=rank,
        world_size=world,
        replica_id=replica,
        layout_digest=digest,
        device=device,
        state=state,
        node=node,
        device_uuid=gpu,
    )


def test_group_ranks_trainers_then_replicas_by_id():
    t1, t0 = _m(Role.TRAINER, 1, 2), _m(Role.TRAINER, 0, 2)
    b0 = _m(Role.GENERATOR, 0, 1, "b")
    a1, a0 = _m(Role.GENERATOR, 1, 2, "a"), _m(Role.GENERATOR, 0, 2, "a")
    sidecar = _m(Role.GENERATOR_SIDECAR, 0, 2, "a", digest="")
    lost = _m(Role.GENERATOR, 0, 1, "c", state=MemberState.LOST)
    roster = Roster.of([t1, b0, a1, sidecar, t0, a0, lost])
    roster.check_trainers()
    assert [m.member_id for m in roster.group_members()] == [
        t0.member_id,
        t1.member_id,
        a0.member_id,
        a1.member_id,
        b0.member_id,
    ]
    assert roster.replicas["a"].sidecar is sidecar
    assert "c" not in roster.replicas  # lost members take no part
    assert [r.replica_id for r in roster.targets([])] == ["a", "b"]
    assert [r.replica_id for r in roster.targets(["b"])] == ["b"]
    assert roster.backend() is Backend.GLOO


def test_incomplete_replicas_are_left_out_of_the_group():
    roster = Roster.of(
        [_m(Role.TRAINER), _m(Role.GENERATOR, 0, 2, "a"), _m(Role.GENERATOR, 0, 1, "b")]
    )
    assert [r.replica_id for r in roster.complete_replicas()] == ["b"]
    with pytest.raises(RefitFailed) as err:
        roster.targets(["a"])
    assert err.value.reason == "MEMBERS_MISSING"
    with pytest.raises(RefitFailed) as err:
        roster.targets(["zz"])
    assert "zz" in err.value.message


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([], "MEMBERS_MISSING"),
        ([_m(Role.TRAINER, 0, 2)], "MEMBERS_MISSING"),
        ([_m(Role.TRAINER, 0, 2), _m(Role.TRAINER, 1, 3)], "INVALID_TOPOLOGY"),
        ([_m(Role.TRAINER, digest="")], "LAYOUT_MISSING"),
    ],
)
def test_trainer_problems(members, reason):
    with pytest.raises(RefitFailed) as err:
        Roster.of(members).check_trainers()
    assert err.value.reason == reason


def test_backends():
    cuda = Roster.of(
        [_m(Role.TRAINER, device="cuda:0"), _m(Role.GENERATOR, replica="a", device="cuda")]
    )
    assert cuda.backend() is Backend.NCCL
    mixed = Roster.of([_m(Role.TRAINER, device="cuda:0"), _m(Role.GENERATOR, replica="a")])
    with pytest.raises(RefitFailed) as err:
        mixed.backend()
    assert err.value.reason == "INVALID_TOPOLOGY"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_plan_cache_reuses_plans_and_survives_a_cold_layout_cache(anyio_backend):
    store = EmbeddedStore()
    layouts = LayoutCache(store)
    src, dst = _layout(0, (0, 8)), _layout(0, (0, 8))
    await layouts.put(src)
    await layouts.put(dst)
    trainer = _m(Role.TRAINER, digest=src.digest)
    gen = _m(Role.GENERATOR, replica="a", digest=dst.digest)
    cache = PlanCache(store, layouts)
    first = await cache.plan([(0, trainer)], [(1, gen)])
    again = await cache.plan([(0, trainer)], [(1, gen)])
    assert again is first
    assert (cache.hits, cache.misses) == (1, 1)
    assert first.plan.total_bytes == 8 * 4 * 4
    assert first.group_ranks == {trainer.member_id: 0, gen.member_id: 1}
    # A fresh coordinator: layouts come back from the store by digest, same plan digest.
    fresh = PlanCache(store, LayoutCache(store))
    assert (await fresh.plan([(0, trainer)], [(1, gen)])).plan.digest == first.plan.digest
    # A different numbering is a different plan.
    moved = await cache.plan([(0, trainer)], [(2, gen)])
    assert moved.plan.digest != first.plan.digest
    missing = _m(Role.GENERATOR, replica="a", digest="nope")
    with pytest.raises(RefitFailed) as err:
        await cache.plan([(0, trainer)], [(1, missing)])
    assert err.value.reason == "LAYOUT_MISSING"


def test_plan_holdings_are_per_member_id_and_epoch():
    from refitplane.coordinator.core.planning import PlanHoldings

    held = PlanHoldings(per_member=2)
    held.acknowledge("m1", 1, ("p", 0))
    assert held.holds("m1", 1, ("p", 0))
    assert not held.holds("m1", 2, ("p", 0))  # a new epoch sends the body again
    assert not held.holds("m2", 1, ("p", 0))  # so does a new member id
    held.acknowledge("m1", 1, ("q", 0))
    held.acknowledge("m1", 1, ("r", 0))
    assert not held.holds("m1", 1, ("p", 0))  # bounded: the oldest is dropped
    held.forget("m1", ("q", 0))
    assert not held.holds("m1", 1, ("q", 0))
    assert held.holds("m1", 1, ("r", 0))
    held.acknowledge("m1", 2, ("r", 0))
    assert not held.holds("m1", 1, ("r", 0))
    held.forget("m1")
    assert not held.holds("m1", 2, ("r", 0))


def _gpu(role, rank=0, world=1, replica="", node="n1", gpu="GPU-a"):
    return _m(role, rank, world, replica, device="cuda:0", node=node, gpu=gpu)


@pytest.mark.parametrize(
    ("trainer", "generator", "same_host", "backend"),
    [
        # One GPU shared by trainer and vLLM (colocated): CUDA IPC whatever the setting.
        (("n1", "GPU-a"), ("n1", "GPU-a"), "nccl", Backend.CUDA_IPC),
        # Two GPUs of one node: the setting decides; auto is NCCL until measured otherwise.
        (("n1", "GPU-a"), ("n1", "GPU-b"), "ipc", Backend.CUDA_IPC),
        (("n1", "GPU-a"), ("n1", "GPU-b"), "nccl", Backend.NCCL),
        (("n1", "GPU-a"), ("n1", "GPU-b"), "auto", Backend.NCCL),
        # Two nodes: NCCL, even when IPC is asked for same-node links.
        (("n1", "GPU-a"), ("n2", "GPU-b"), "ipc", Backend.NCCL),
        # Nobody named a node: never IPC across GPUs.
        (("", "GPU-a"), ("", "GPU-b"), "ipc", Backend.NCCL),
    ],
)
def test_backend_from_registered_nodes_and_gpus(trainer, generator, same_host, backend):
    roster = Roster.of(
        [
            _gpu(Role.TRAINER, node=trainer[0], gpu=trainer[1]),
            _gpu(Role.GENERATOR, replica="a", node=generator[0], gpu=generator[1]),
        ]
    )
    assert roster.backend([(0, 1)], same_host) is backend


def test_shared_gpu_in_a_group_that_spans_nodes_is_refused_by_name():
    # Trainer 0 and replica a share GPU-a on n1; trainer 1 sends to replica b on n2.
    roster = Roster.of(
        [
            _gpu(Role.TRAINER, 0, 2, node="n1", gpu="GPU-a"),
            _gpu(Role.TRAINER, 1, 2, node="n2", gpu="GPU-c"),
            _gpu(Role.GENERATOR, replica="a", node="n1", gpu="GPU-a"),
            _gpu(Role.GENERATOR, replica="b", node="n2", gpu="GPU-d"),
        ]
    )
    with pytest.raises(RefitFailed) as err:
        roster.backend([(0, 2), (1, 3)], "auto")
    assert err.value.reason == "INVALID_TOPOLOGY"
    assert "share GPU GPU-a" in err.value.message
    assert "trainer rank 0" in err.value.message
    assert "generator replica 'a' rank 0" in err.value.message
