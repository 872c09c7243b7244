"""The orchestrator clients (sync and async) against a real coordinator: results are the
pydantic models, failures the domain errors; no protobuf in sight."""

from __future__ import annotations

import asyncio

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.client import AsyncRefitClient, Refit, RefitClient, Topology
from refitplane.errors import FailedPrecondition, NotFound, TransferTimeout
from refitplane.protocol import RefitState

pytestmark = pytest.mark.integration


def _cluster(sim_cluster, coord, **behaviour):
    cluster = sim_cluster(coord)
    cluster.trainers(world=1, behaviour=Behaviour(**behaviour))
    cluster.replica("a")
    return cluster


def test_async_client(coordinator, sim_cluster):
    _cluster(sim_cluster, coordinator)

    async def scenario() -> None:
        async with AsyncRefitClient(coordinator.grpc_target) as client:
            refit = await client.trigger("job", idempotency_key="a1", version=5)
            assert isinstance(refit, Refit)
            seen = [r.state async for r in client.watch(refit.refit_id, timeout_s=15)]
            assert seen[-1] is RefitState.COMMITTED
            assert (await client.wait(refit.refit_id, timeout_s=5)).version == 5
            assert (await client.get(refit.refit_id)).state is RefitState.COMMITTED
            assert [r.refit_id for r in await client.list("job")] == [refit.refit_id]
            topo = await client.topology("job")
            assert isinstance(topo, Topology)
            assert topo.committed_version == 5
            with pytest.raises(FailedPrecondition):
                await client.cancel(refit.refit_id)
            with pytest.raises(NotFound):
                await client.get("missing")

    asyncio.run(scenario())


def test_sync_watch_streams_every_phase_and_times_out(coordinator, sim_cluster):
    cluster = _cluster(sim_cluster, coordinator, delay_s={"start_transfer": 0.3})
    with RefitClient(coordinator.grpc_target) as client:
        refit = client.trigger("job")
        states = [r.state for r in client.watch(refit.refit_id, timeout_s=15)]
        assert states[-1] is RefitState.COMMITTED
        assert RefitState.TRANSFERRING in states
        assert states.index(RefitState.TRANSFERRING) < states.index(RefitState.COMMITTED)
        for m in cluster.members:
            m.agent.behaviour = Behaviour(hold_transfer_s=30)
        held = client.trigger("job")
        with pytest.raises(TransferTimeout) as err:
            client.wait(held.refit_id, timeout_s=0.5)
        assert err.value.field == "refit_id"
        client.cancel(held.refit_id)
