"""refit.v1.RefitService over the core: convert, call, convert back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane._generated.refit.v1 import orchestrator_pb2_grpc
from refitplane.coordinator.core.service import Coordinator
from refitplane.protocol.convert import refit_to_proto, topology_to_proto

Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_LIST_LIMIT = 50


class RefitServicer(orchestrator_pb2_grpc.RefitServiceServicer):
    def __init__(self, core: Coordinator) -> None:
        self._core = core

    async def TriggerRefit(self, request: opb.TriggerRefitRequest, context: Context) -> cpb.Refit:
        refit = await self._core.trigger(
            request.job,
            target_replicas=list(request.target_replicas),
            idempotency_key=request.idempotency_key,
            version=request.version,
        )
        return refit_to_proto(refit)

    async def GetRefit(self, request: opb.GetRefitRequest, context: Context) -> cpb.Refit:
        return refit_to_proto(await self._core.get_refit(request.refit_id))

    async def ListRefits(
        self, request: opb.ListRefitsRequest, context: Context
    ) -> opb.ListRefitsResponse:
        refits = await self._core.list_refits(request.job, request.limit or DEFAULT_LIST_LIMIT)
        return opb.ListRefitsResponse(refits=[refit_to_proto(r) for r in refits])

    async def CancelRefit(self, request: opb.CancelRefitRequest, context: Context) -> cpb.Refit:
        return refit_to_proto(await self._core.cancel(request.refit_id))

    async def WatchRefit(
        self, request: opb.WatchRefitRequest, context: Context
    ) -> AsyncIterator[cpb.Refit]:
        async for refit in self._core.watch(request.refit_id):
            yield refit_to_proto(refit)

    async def GetTopology(self, request: opb.GetTopologyRequest, context: Context) -> cpb.Topology:
        return topology_to_proto(await self._core.topology(request.job))
