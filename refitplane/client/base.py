"""What `RefitClient` and `AsyncRefitClient` share: one channel to the coordinator, its stub,
the token's metadata and the per-call timeout, built from arguments or `ClientSettings`; and
the requests both send, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane._generated.refit.v1 import orchestrator_pb2_grpc
from refitplane.protocol.channel import auth_metadata
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
