"""Build the grpc.aio server: refit.v1 services behind the interceptor, health, reflection
(v1 and v1alpha)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from grpc import aio, ssl_server_credentials
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from refitplane._generated.refit.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)
from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.core.service import Coordinator
from refitplane.coordinator.grpc.agent_servicer import AgentServicer
from refitplane.coordinator.grpc.interceptor import RefitInterceptor
from refitplane.coordinator.grpc.refit_servicer import RefitServicer
from refitplane.coordinator.grpc.reflection import enable_reflection
from refitplane.protocol.channel import MAX_MESSAGE_BYTES

SERVICE_NAMES = (
    orchestrator_pb2.DESCRIPTOR.services_by_name["RefitService"].full_name,
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
)
_OPTIONS = (
    # Plans going down to agents may be large; what comes in is capped per server
    # (REFIT_GRPC_MAX_RECEIVE_BYTES): gRPC refuses a larger message from its length prefix,
    # before reading it (RESOURCE_EXHAUSTED), authenticated or not.
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Find dead agents' streams without waiting for TCP timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default (SO_REUSEPORT) lets a second coordinator listen on the same port, each
    # with its own state; refuse instead.
    ("grpc.so_reuseport", 0),
)


class GrpcServer:
    def __init__(
        self,
        core: Coordinator,
        tokens: TokenCheck,
        *,
        tls: tuple[bytes, bytes] | None = None,
        outer: Sequence[aio.ServerInterceptor] = (),
        lane_port: Callable[[], int] = lambda: 0,
    ) -> None:
        """`outer` interceptors run around the refit.v1 one (request metrics, access log);
        `lane_port`: the control lane's port, told to agents at registration."""
        interceptors = [*outer, RefitInterceptor(tokens)]
        options = (
            *_OPTIONS,
            ("grpc.max_receive_message_length", core.settings.grpc_max_receive_bytes),
        )
        self.server = aio.server(interceptors=interceptors, options=options)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentServicer(core, lane_port=lane_port), self.server
        )
        orchestrator_pb2_grpc.add_RefitServiceServicer_to_server(RefitServicer(core), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # NOT_SERVING while the core is not ready (a store that lost its state, re-seeding).
        core.on_readiness(self._set_serving)
        enable_reflection(self.server, (*SERVICE_NAMES, health.SERVICE_NAME))
        self._tls = tls

    def bind(self, host: str, port: int) -> int:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._tls is not None:
            key, cert = self._tls
            bound = self.server.add_secure_port(address, ssl_server_credentials([(key, cert)]))
        else:
            bound = self.server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {address}")
        return bound

    async def start(self) -> None:
        await self.server.start()
        await self._set_serving(True)

    async def _set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
