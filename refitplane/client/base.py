"""What `RefitClient` and `AsyncRefitClient` share: one channel to the coordinator, its stub,
the token's metadata and the per-call timeout, built from arguments or `ClientSettings`; and
the requests both send and the errors a watch raises, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import grpc

from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane._generated.refit.v1 import orchestrator_pb2_grpc
from refitplane.errors import RefitError, TransferTimeout
from refitplane.protocol.channel import auth_metadata, from_rpc_error
from refitplane.protocol.settings import ClientSettings


class ClientBase:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._channel = self._open(target, tls_ca)
        self._stub = orchestrator_pb2_grpc.RefitServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self._timeout = timeout_s

    @staticmethod
    def _open(target: str, tls_ca: str | Path | None) -> Any:
        """The channel (blocking or asyncio) this client calls over."""
        raise NotImplementedError

    def _watch_call(self, refit_id: str, timeout_s: float | None) -> Any:
        """The WatchRefit stream of `refit_id` (blocking or asyncio, as the channel is)."""
        return self._stub.WatchRefit(
            opb.WatchRefitRequest(refit_id=refit_id),
            timeout=timeout_s,
            metadata=self._metadata,
            wait_for_ready=True,
        )

    @classmethod
    def from_env(cls, settings: ClientSettings | None = None, **kwargs: Any) -> Self:
        """From REFIT_COORDINATOR, REFIT_AUTH_TOKEN(_FILE), REFIT_TLS_CA_FILE."""
        s = settings or ClientSettings()
        return cls(s.coordinator, token=s.token(), tls_ca=s.tls_ca_file, **kwargs)


def trigger_request(
    job: str, target_replicas: Sequence[str], idempotency_key: str, version: int
) -> opb.TriggerRefitRequest:
    return opb.TriggerRefitRequest(
        job=job,
        target_replicas=list(target_replicas),
        idempotency_key=idempotency_key,
        version=version,
    )


def watch_error(exc: grpc.RpcError, refit_id: str, timeout_s: float | None) -> RefitError:
    """What a broken WatchRefit stream raises: a TransferTimeout naming the refit once
    `timeout_s` passed, else the coordinator's error."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(
            f"refit {refit_id} did not finish within {timeout_s:g} s", field="refit_id"
        )
    return from_rpc_error(exc)
