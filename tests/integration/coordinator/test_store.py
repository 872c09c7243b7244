"""One test suite for both stores (embedded and Redis): registration with replacement,
layouts, the atomic trigger (idempotency, versions, coalescing), compare-and-set
transitions with pointer promotion, groups, replicas, listing and retention."""

from __future__ import annotations

import time
import uuid

import pytest

from refitplane.coordinator.core.records import (
    GroupRecord,
    GroupState,
    MemberRecord,
    PlanInfo,
    ReplicaRecord,
    TriggerOutcome,
    TriggerRequest,
)
from refitplane.coordinator.store import base as store_base
from refitplane.coordinator.store import open_store
from refitplane.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from refitplane.protocol import Backend, MemberState, RefitState, Role

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def store(store_url):
    s = open_store(store_url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    yield s
    await s.close()


def _member(rank=0, role=Role.GENERATOR, replica="a", job="job"):
    return MemberRecord(
        member_id=uuid.uuid4().hex, job=job, role=role, replica_id=replica, rank=rank
    )


def _trigger(job="job", version=0, key="", targets=()):
    return TriggerRequest(
        job=job,
        version=version,
        target_replicas=list(targets),
        idempotency_key=key,
        now=time.time(),
        new_id=uuid.uuid4().hex,
    )


async def test_register_replaces_same_key(store):
    first = _member()
    assert await store.register_member(first) is None
    other = _member(rank=1)
    assert await store.register_member(other) is None
    second = _member()
    assert await store.register_member(second) == first.member_id
    ids = {m.member_id for m in await store.load_members()}
    assert ids == {second.member_id, other.member_id}
    # Saving a replaced member must not resurrect it.
    await store.save_member(first.model_copy(update={"state": MemberState.READY}))
    assert first.member_id not in {m.member_id for m in await store.load_members()}
    # Deleting the replaced member leaves the new one's index entry alone.
    await store.delete_member(first)
    assert await store.register_member(_member()) == second.member_id


async def test_save_and_delete_member(store):
    m = _member(role=Role.TRAINER, replica="")
    await store.register_member(m)
    await store.save_member(m.model_copy(update={"layout_digest": "abc", "version": 3}))
    (loaded,) = await store.load_members()
    assert loaded.layout_digest == "abc"
    assert loaded.version == 3
    await store.delete_member(m)
    assert await store.load_members() == []


async def test_layouts_and_plan_info(store):
    await store.put_layout("d1", '{"tensors": []}')
    await store.put_layout("d1", "ignored: content-addressed")
    assert await store.get_layout("d1") == '{"tensors": []}'
    assert await store.get_layout("missing") is None
    info = PlanInfo(
        key="k",
        plan_digest="p",
        source_digest="s",
        target_digest="t",
        total_bytes=10,
        num_links=1,
        num_tensors=1,
        created_unix=1.0,
    )
    await store.put_plan_info(info)
    assert await store.get_plan_info("k") == info
    assert await store.get_plan_info("nope") is None


async def test_trigger_versions_and_idempotency(store):
    first = await store.trigger(_trigger(key="k"))
    assert first.outcome is TriggerOutcome.CREATED
    assert first.refit.version == 1
    assert first.refit.state is RefitState.PENDING
    assert first.refit.target_replicas == []
    again = await store.trigger(_trigger(key="k"))
    assert again.outcome is TriggerOutcome.EXISTING
    assert again.refit.refit_id == first.refit.refit_id
    explicit = await store.trigger(_trigger(version=10, targets=["b", "a"]))
    assert explicit.refit.version == 10
    assert explicit.refit.target_replicas == ["b", "a"]
    with pytest.raises(FailedPrecondition) as err:
        await store.trigger(_trigger(version=10))
    assert err.value.field == "version"
    with pytest.raises(InvalidArgument):
        await store.trigger(_trigger(version=store_base.MAX_VERSION + 1))
    job = await store.load_job("job")
    assert job.active == first.refit.refit_id
    assert job.pending == explicit.refit.refit_id
    assert job.last_version == 10


async def test_trigger_coalesces_into_pending(store):
    active = (await store.trigger(_trigger())).refit
    pending = (await store.trigger(_trigger(targets=["a"]))).refit
    merged = await store.trigger(_trigger(targets=["c", "b"], key="late"))
    assert merged.outcome is TriggerOutcome.COALESCED
    assert merged.refit.refit_id == pending.refit_id
    assert merged.refit.version == 3
    assert merged.refit.coalesced == 1
    assert merged.refit.target_replicas == ["a", "b", "c"]
    # "Every replica" absorbs a targeted trigger.
    everyone = await store.trigger(_trigger())
    assert everyone.refit.target_replicas == []
    assert everyone.refit.coalesced == 2
    assert (await store.trigger(_trigger(key="late"))).refit.refit_id == pending.refit_id
    assert (await store.get_refit(pending.refit_id)).version == 4
    assert active.version == 1


async def test_transition_is_compare_and_set_and_promotes_pending(store):
    active = (await store.trigger(_trigger())).refit
    pending = (await store.trigger(_trigger())).refit
    preparing = active.model_copy(update={"state": RefitState.PREPARING})
    await store.transition(preparing, [RefitState.PENDING])
    with pytest.raises(Conflict) as err:
        await store.transition(preparing, [RefitState.PENDING])
    assert "PREPARING" in err.value.message
    with pytest.raises(NotFound):
        await store.transition(
            preparing.model_copy(update={"refit_id": "nope"}), [RefitState.PENDING]
        )
    committed = preparing.model_copy(update={"state": RefitState.COMMITTED, "replicas_done": ["a"]})
    await store.transition(committed, [RefitState.PREPARING])
    job = await store.load_job("job")
    assert job.active == pending.refit_id
    assert job.pending == ""
    assert job.committed_version == 1
    stored = await store.get_refit(active.refit_id)
    assert stored.state is RefitState.COMMITTED
    assert stored.replicas_done == ["a"]
    # Cancelling the (now active) pending refit clears the pointer.
    await store.transition(
        pending.model_copy(update={"state": RefitState.CANCELLED}), [RefitState.PENDING]
    )
    assert (await store.load_job("job")).active == ""


async def test_list_is_newest_first_and_old_records_are_trimmed(store, monkeypatch):
    monkeypatch.setattr(store_base, "REFITS_KEPT_PER_JOB", 3)
    import refitplane.coordinator.store.embedded as embedded
    import refitplane.coordinator.store.redis_store as redis_store

    monkeypatch.setattr(embedded, "REFITS_KEPT_PER_JOB", 3)
    monkeypatch.setattr(redis_store, "REFITS_KEPT_PER_JOB", 3)
    ids = []
    for _ in range(5):
        refit = (await store.trigger(_trigger())).refit
        ids.append(refit.refit_id)
        await store.transition(
            refit.model_copy(update={"state": RefitState.FAILED}), [RefitState.PENDING]
        )
    listed = await store.list_refits("job", 10)
    assert [r.refit_id for r in listed] == ids[::-1][:3]
    assert await store.get_refit(ids[0]) is None
    assert [r.version for r in await store.list_refits("job", 2)] == [5, 4]
    assert await store.list_refits("other", 10) == []


async def test_groups_replicas_and_jobs(store):
    empty = await store.load_job("job")
    assert empty.group.state is GroupState.NONE
    assert empty.replicas == {}
    group = GroupRecord(
        job="job", epoch=3, state=GroupState.READY, backend=Backend.NCCL, members=["x", "y"]
    )
    await store.save_group(group)
    await store.save_group(GroupRecord(job="job2", epoch=1, members=[]))
    await store.save_replicas("job", [ReplicaRecord(replica_id="a", degraded=True)])
    job = await store.load_job("job")
    assert job.group == group
    assert job.replicas["a"].degraded
    assert (await store.load_job("job2")).group.members == []
    await store.register_member(_member(job="job3"))
    assert "job3" in await store.jobs()


async def test_unreachable_redis_is_unavailable():
    s = open_store("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(Unavailable) as err:
            await s.ping()
        assert "127.0.0.1:1" not in err.value.message
    finally:
        await s.close()


async def test_active_refit_follows_the_pointer(store):
    assert await store.active_refit("job") is None
    first = (await store.trigger(_trigger())).refit
    second = (await store.trigger(_trigger())).refit
    assert (await store.active_refit("job")).refit_id == first.refit_id
    await store.transition(
        first.model_copy(update={"state": RefitState.FAILED}), [RefitState.PENDING]
    )
    assert (await store.active_refit("job")).refit_id == second.refit_id


async def test_reseeding_a_store_that_lost_its_state(store):
    """What the coordinator relies on to re-seed (core/lost_state.py): members are upserted,
    a member's held version and the re-seed raise the job's versions (never lower them),
    the refit in flight can be written back, and triggers check the claimed sentinel."""
    incarnation = await store.claim_incarnation()
    assert await store.claim_incarnation() == incarnation
    assert await store.incarnation() == incarnation
    # A member saved that the store does not know (it lost it) is written back whole.
    lost = _member().model_copy(update={"version": 3})
    await store.save_member(lost)
    assert [m.member_id for m in await store.load_members()] == [lost.member_id]
    # Registering a member that holds version 5 raises the job's last-used version.
    await store.register_member(_member(rank=1).model_copy(update={"version": 5}))
    assert (await store.load_job("job")).last_version == 5
    await store.raise_versions("job", last_version=4, committed_version=2)
    job = await store.load_job("job")
    assert (job.last_version, job.committed_version) == (5, 2)
    assert (await store.trigger(_trigger())).refit.version == 6
    restored = (await store.trigger(_trigger())).refit.model_copy(update={"version": 9})
    await store.restore_refit(restored)
    assert (await store.active_refit("job")) == restored


async def test_a_restored_idempotency_key_names_its_refit(store):
    """Re-seed writes a key back (`idempotency_keys`): a trigger with it finds the refit it
    named, and what the store holds is never overwritten."""
    named = (await store.trigger(_trigger(version=7))).refit.model_copy(
        update={"state": RefitState.COMMITTED}
    )
    await store.restore_idempotency_key("job", "k", named, 3600)
    again = await store.trigger(_trigger(key="k"))
    assert again.outcome is TriggerOutcome.EXISTING
    assert again.refit.refit_id == named.refit_id
    other = (await store.trigger(_trigger(key="other"))).refit
    await store.restore_idempotency_key("job", "other", named, 3600)
    assert (await store.trigger(_trigger(key="other"))).refit.refit_id == other.refit_id
    # A refit the store lost comes back into the job's history.
    gone = named.model_copy(update={"refit_id": "lost-refit"})
    await store.restore_idempotency_key("job", "k2", gone, 3600)
    assert (await store.get_refit("lost-refit")) == gone
    assert "lost-refit" in [r.refit_id for r in await store.list_refits("job", 100)]


@pytest.fixture
async def claimed(store_url):
    """A Redis store that claimed its incarnation sentinel, and its key prefix (the
    embedded store cannot lose part of its state)."""
    if not store_url:
        pytest.skip("the embedded store cannot lose part of its state")
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = open_store(store_url, prefix=prefix)
    await store.claim_incarnation()
    yield store, prefix
    await store.close()


async def _wipe(store_url, prefix, *keys):
    """Delete `keys` (under `prefix`) as a FLUSHALL would, through a connection of its own."""
    wiper = open_store(store_url, prefix=prefix)
    await wiper._redis.delete(*(prefix + key for key in keys))
    await wiper.close()


async def test_trigger_refuses_a_store_that_lost_its_sentinel(store_url, claimed):
    store, prefix = claimed
    await store.trigger(_trigger())
    await _wipe(store_url, prefix, "incarnation")
    with pytest.raises(store_base.StoreStateLost):
        await store.trigger(_trigger())


async def test_a_transition_on_a_store_that_lost_its_state_is_not_an_unknown_refit(
    store_url, claimed
):
    # A driver's write that finds its record wiped before the store check noticed the loss
    # (a FLUSHALL mid-refit) is StoreStateLost, so the driver fails the refit
    # STORE_STATE_LOST once the record is written back; a refit the store never had stays
    # NotFound.
    store, prefix = claimed
    refit = (await store.trigger(_trigger())).refit
    running = refit.model_copy(update={"state": RefitState.PREPARING})
    await store.transition(running, [RefitState.PENDING])
    unknown = running.model_copy(update={"refit_id": "never-triggered"})
    with pytest.raises(NotFound):
        await store.transition(unknown, [RefitState.PREPARING])
    await _wipe(store_url, prefix, "incarnation", f"refit:{refit.refit_id}")
    with pytest.raises(store_base.StoreStateLost):
        await store.transition(running, [RefitState.PREPARING])
    # Once the refit is written back (the re-seed), the driver's write goes through.
    await store.restore_refit(running)
    failed = running.model_copy(update={"state": RefitState.FAILED})
    await store.transition(failed, [RefitState.PREPARING])
    assert (await store.get_refit(refit.refit_id)).state is RefitState.FAILED
