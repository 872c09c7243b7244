"""`RefitClient`: the blocking orchestrator client (RL frameworks, scripts, refitctl)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane.client.base import ClientBase, trigger_request, watch_error
from refitplane.protocol.channel import from_rpc_error, sync_channel
from refitplane.protocol.convert import refit_from_proto, topology_from_proto
from refitplane.protocol.models import Refit, Topology


class RefitClient(ClientBase):
    """Trigger, inspect, cancel and watch refits. No protobuf in or out: results are the
    pydantic models of `refitplane.protocol.models`; failures are `refitplane.errors`."""

    @staticmethod
    def _open(target: str, tls_ca: str | Path | None) -> Any:
        return sync_channel(target, tls_ca=tls_ca)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RefitClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(
                request, timeout=self._timeout, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def trigger(
        self,
        job: str,
        *,
        target_replicas: Sequence[str] = (),
        idempotency_key: str = "",
        version: int = 0,
    ) -> Refit:
        request = trigger_request(job, target_replicas, idempotency_key, version)
        return refit_from_proto(self._call("TriggerRefit", request))

    def get(self, refit_id: str) -> Refit:
        return refit_from_proto(self._call("GetRefit", opb.GetRefitRequest(refit_id=refit_id)))

    def list(self, job: str, *, limit: int = 50) -> list[Refit]:
        resp = self._call("ListRefits", opb.ListRefitsRequest(job=job, limit=limit))
        return [refit_from_proto(r) for r in resp.refits]

    def cancel(self, refit_id: str) -> Refit:
        return refit_from_proto(
            self._call("CancelRefit", opb.CancelRefitRequest(refit_id=refit_id))
        )

    def topology(self, job: str) -> Topology:
        return topology_from_proto(self._call("GetTopology", opb.GetTopologyRequest(job=job)))

    def watch(self, refit_id: str, *, timeout_s: float | None = None) -> Iterator[Refit]:
        """The refit now and on every change until it is terminal (or `timeout_s` passes:
        TransferTimeout)."""
        call = self._watch_call(refit_id, timeout_s)
        try:
            for msg in call:
                yield refit_from_proto(msg)
        except grpc.RpcError as exc:
            raise watch_error(exc, refit_id, timeout_s) from None
        finally:
            call.cancel()

    def wait(self, refit_id: str, *, timeout_s: float) -> Refit:
        """Block until the refit is COMMITTED, FAILED or CANCELLED; returns the final record."""
        deadline = time.monotonic() + timeout_s
        last: Refit | None = None
        for last in self.watch(refit_id, timeout_s=max(0.001, deadline - time.monotonic())):
            if last.terminal:
                return last
        return last if last is not None else self.get(refit_id)
