"""`AsyncRefitClient`: the asyncio orchestrator client (same methods as `RefitClient`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane.client.base import ClientBase, trigger_request, watch_error
from refitplane.protocol.channel import aio_channel, from_rpc_error
from refitplane.protocol.convert import refit_from_proto, topology_from_proto
from refitplane.protocol.models import Refit, Topology


class AsyncRefitClient(ClientBase):
    @staticmethod
    def _open(target: str, tls_ca: str | Path | None) -> Any:
        return aio_channel(target, tls_ca=tls_ca)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncRefitClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(
                request, timeout=self._timeout, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def trigger(
        self,
        job: str,
        *,
        target_replicas: Sequence[str] = (),
        idempotency_key: str = "",
        version: int = 0,
    ) -> Refit:
        request = trigger_request(job, target_replicas, idempotency_key, version)
        return refit_from_proto(await self._call("TriggerRefit", request))

    async def get(self, refit_id: str) -> Refit:
        msg = await self._call("GetRefit", opb.GetRefitRequest(refit_id=refit_id))
        return refit_from_proto(msg)

    async def list(self, job: str, *, limit: int = 50) -> list[Refit]:
        resp = await self._call("ListRefits", opb.ListRefitsRequest(job=job, limit=limit))
        return [refit_from_proto(r) for r in resp.refits]

    async def cancel(self, refit_id: str) -> Refit:
        msg = await self._call("CancelRefit", opb.CancelRefitRequest(refit_id=refit_id))
        return refit_from_proto(msg)

    async def topology(self, job: str) -> Topology:
        msg = await self._call("GetTopology", opb.GetTopologyRequest(job=job))
        return topology_from_proto(msg)

    async def watch(self, refit_id: str, *, timeout_s: float | None = None) -> AsyncIterator[Refit]:
        call = self._watch_call(refit_id, timeout_s)
        try:
            async for msg in call:
                yield refit_from_proto(msg)
        except grpc.RpcError as exc:
            raise watch_error(exc, refit_id, timeout_s) from None
        finally:
            call.cancel()

    async def wait(self, refit_id: str, *, timeout_s: float) -> Refit:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: Refit | None = None
        async for last in self.watch(refit_id, timeout_s=max(0.001, deadline - loop.time())):
            if last.terminal:
                return last
        return last if last is not None else await self.get(refit_id)
