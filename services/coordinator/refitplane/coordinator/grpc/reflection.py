"""Server reflection under both service names: `grpc.reflection.v1alpha.ServerReflection`
(what grpcio-reflection ships) and `grpc.reflection.v1.ServerReflection` (what grpcurl,
Postman and current clients ask first). The two protos are the same messages with the same
field numbers under another package, so one servicer answers both."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc import aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: aio.Server, service_names: Iterable[str]) -> None:
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for service in (reflection.SERVICE_NAME, V1_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )
