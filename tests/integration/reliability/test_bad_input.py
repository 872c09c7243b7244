"""Bad input against the coordinator as a real process (on Redis), next to a job of real
trainer and generator ranks that must keep working throughout.

* schemathesis against the REST schema the process serves: no server errors, responses
  conform to the schema;
* every gRPC method of refit.v1 fed random bytes and random messages built from its
  descriptor (hypothesis; sometimes aimed at a real registered member): only the documented
  client-error codes, never INTERNAL / UNKNOWN / UNAVAILABLE;
* malformed layouts (negative and huge dims, out-of-range and overlapping boxes, boxes of
  the wrong rank, unknown dtypes, the same tensor twice with two dtypes) → INVALID_ARGUMENT
  naming the field; a trainer and a generator that disagree on a tensor's dtype or shape →
  the refit fails INVALID_LAYOUT naming the tensor, before any command goes out;
* tens of thousands of tensors: a 20,000-tensor layout is accepted and planned, and one bad
  tensor among them is named by its index;
* afterwards the coordinator still serves: health SERVING, the real job commits a refit,
  and its log holds no traceback.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
import httpx
import pytest
import schemathesis
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refitplane._generated.refit.v1 import agent_pb2, common_pb2, orchestrator_pb2
from refitplane.agent.simulated import SimulatedAgent
from refitplane.protocol import RefitState, Role
from refitplane.protocol.channel import Metadata, member_metadata
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from tests.integration.reliability.conftest import start_world
from tests.integration.reliability.support import World
from tests.support.rest_fuzz import call_and_validate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLIENT_ERRORS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    # A member call without that member's credential (fuzzed ids, random bytes).
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}
FUZZ_JOB = "fuzz-job"


class FuzzMember(NamedTuple):
    member_id: str
    metadata: Metadata


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = start_world(
        tmp_path_factory.mktemp("bad-input"),
        trainers=1,
        replicas={"rep-0": 1},
        env={"REFIT_LEASE_TTL_S": "15"},  # fuzz members live through the whole module
    )
    try:
        yield w
    finally:
        w.cluster.close()


@pytest.fixture(scope="module")
def channel(world: World) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(world.cluster.coordinator.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def fuzz_member(channel: grpc.Channel) -> FuzzMember:
    """A real registered trainer of another job, for fuzzed calls to aim at (with its
    credential, so they reach past authentication)."""
    register = _unary(channel, "refit.v1.AgentService", "Register", agent_pb2.RegisterRequest)
    reply = agent_pb2.RegisterResponse.FromString(
        register(
            agent_pb2.RegisterRequest(
                job=FUZZ_JOB, role=common_pb2.ROLE_TRAINER, world_size=1, device="cpu"
            ).SerializeToString(),
            timeout=5,
        )
    )
    return FuzzMember(reply.member_id, member_metadata(None, reply.member_credential))


def _unary(channel: grpc.Channel, service: str, method: str, request: Any) -> Any:
    return channel.unary_unary(
        f"/{service}/{method}", request_serializer=lambda b: b, response_deserializer=bytes
    )


def _methods() -> list[tuple[str, str, Any, bool]]:
    out = []
    for module in (agent_pb2, orchestrator_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                request = getattr(module, m.input_type.name, None) or getattr(
                    common_pb2, m.input_type.name
                )
                out.append((service.full_name, m.name, request, m.server_streaming))
    return out


METHODS = _methods()


def _status(
    channel: grpc.Channel,
    service: str,
    method: str,
    stream: bool,
    raw: bytes,
    metadata: Metadata = (),
) -> Any:
    path = f"/{service}/{method}"
    try:
        if stream:
            call = channel.unary_stream(path, request_serializer=lambda b: b)
            for _ in call(raw, timeout=1.5, metadata=metadata):
                pass
        else:
            _unary(channel, service, method, None)(raw, timeout=5, metadata=metadata)
    except grpc.RpcError as exc:
        return exc
    return None


def _check(exc: Any, stream: bool, where: str) -> None:
    if exc is None:
        return
    allowed = CLIENT_ERRORS | ({grpc.StatusCode.DEADLINE_EXCEEDED} if stream else set())
    assert exc.code() in allowed, (where, exc.code(), exc.details())
    if exc.code() not in {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK}:
        trailers = dict(exc.trailing_metadata() or ())
        assert trailers.get("refit-reason"), (where, exc.details())


# --- messages built from descriptors ------------------------------------------------------------

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.one_of(
        # Never the real job's name: a fuzzed Register could replace its real members.
        st.text(max_size=40),
        st.sampled_from(["", FUZZ_JOB, "x" * 5000]),
    ),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
    FieldDescriptor.TYPE_ENUM: st.integers(-3, 12),  # unknown values too
}


def message(cls: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Any message of type `cls`: every field maybe set, to anything its wire type allows."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in cls.DESCRIPTOR.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                key = _SCALARS[f.message_type.fields_by_name["key"].type]
                value = _SCALARS.get(f.message_type.fields_by_name["value"].type, st.none())
                fields[f.name] = st.dictionaries(key, value, max_size=3)
                continue
            if depth >= 3:
                continue
            sub = message(_class_of(f), depth + 1)
        else:
            sub = _SCALARS[f.type]
        fields[f.name] = st.lists(sub, max_size=3) if f.is_repeated else sub
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: _build(cls, kw))


def _class_of(field: Any) -> Any:
    name = field.message_type.name
    for module in (common_pb2, agent_pb2, orchestrator_pb2):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def _build(cls: Any, values: dict[str, Any]) -> Any:
    msg = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        is_map = field.type == FieldDescriptor.TYPE_MESSAGE and (
            field.message_type.GetOptions().map_entry
        )
        try:
            if is_map:
                getattr(msg, name).update({k: v for k, v in value.items() if v is not None})
            elif field.is_repeated:
                getattr(msg, name).extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError):
            pass  # a value this field cannot hold: leave it unset
    return msg


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_grpc_messages_get_client_errors_only(channel, fuzz_member, data) -> None:
    service, method, request, stream = data.draw(st.sampled_from(METHODS))
    msg = data.draw(message(request))
    aimable = "member_id" in request.DESCRIPTOR.fields_by_name and method != "Deregister"
    metadata: Metadata = ()
    if aimable and data.draw(st.booleans()):
        msg.member_id = fuzz_member.member_id  # reach past the member lookup and auth
        metadata = fuzz_member.metadata
    exc = _status(channel, service, method, stream, msg.SerializeToString(), metadata)
    _check(exc, stream, f"{method}({msg})"[:400])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), raw=st.binary(min_size=1, max_size=256))
def test_random_bytes_get_client_errors_only(channel, data, raw) -> None:
    service, method, _, stream = data.draw(st.sampled_from(METHODS))
    _check(_status(channel, service, method, stream, raw), stream, f"{method}({raw!r})")


# --- layouts --------------------------------------------------------------------------------------


def _tensor(name: str, shape: list[int], dtype: str, boxes: list[list[tuple[int, int]]]) -> Any:
    return common_pb2.TensorBoxes(
        spec=common_pb2.TensorSpec(name=name, shape=shape, dtype=dtype),
        boxes=[common_pb2.Box(start=[a for a, _ in b], stop=[z for _, z in b]) for b in boxes],
    )


def _publish(channel: grpc.Channel, member: FuzzMember, tensors: list[Any]) -> Any:
    request = agent_pb2.PublishLayoutRequest(
        member_id=member.member_id, layout=common_pb2.RankLayout(tensors=tensors)
    )
    return _status(
        channel,
        "refit.v1.AgentService",
        "PublishLayout",
        False,
        request.SerializeToString(),
        member.metadata,
    )


_dims = st.one_of(st.integers(-3, 9), st.integers(2**31, 2**63 - 1))
_dtypes = st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "float128", "", "int4"])
_box = st.lists(st.tuples(_dims, _dims), min_size=0, max_size=3)
_tensors = st.lists(
    st.builds(
        _tensor,
        st.sampled_from(["w", "b", "model.norm.weight", ""]),
        st.lists(_dims, max_size=3),
        _dtypes,
        st.lists(_box, max_size=3),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(tensors=_tensors)
def test_fuzzed_layouts_are_accepted_or_named(channel, fuzz_member, tensors) -> None:
    started = time.monotonic()
    exc = _publish(channel, fuzz_member, tensors)
    assert time.monotonic() - started < 5
    if exc is not None:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert dict(exc.trailing_metadata())["refit-field"].startswith("layout"), exc.details()


@pytest.mark.parametrize(
    ("tensor", "field", "named"),
    [
        (_tensor("w", [-4, 8], "float32", [[(0, 1), (0, 8)]]), "spec.shape", "dimension 0"),
        (_tensor("w", [2**62, 2**62], "float32", [[(0, 1), (0, 1)]]), "spec.shape", ""),
        (_tensor("w", [8, 8], "float32", [[(0, 9), (0, 8)]]), "boxes[0]", "[0:9, 0:8]"),
        (_tensor("w", [8, 8], "float32", [[(-1, 8), (0, 8)]]), "boxes[0]", ""),
        (_tensor("w", [8, 8], "float32", [[(0, 8)]]), "boxes[0]", ""),
        (
            _tensor("w", [8, 8], "float32", [[(0, 6), (0, 8)], [(4, 8), (0, 8)]]),
            "boxes[1]",
            "overlaps",
        ),
        (_tensor("w", [8, 8], "float32", [[(5, 3), (0, 8)]]), "boxes[0]", ""),
        (_tensor("w", [8, 8], "complex32", [[(0, 8), (0, 8)]]), "spec.dtype", "complex32"),
    ],
)
def test_malformed_layouts_name_the_field(channel, fuzz_member, tensor, field, named) -> None:
    exc = _publish(channel, fuzz_member, [tensor])
    assert exc is not None
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(exc.trailing_metadata())["refit-field"] == f"layout.tensors[0].{field}"
    assert named in exc.details()


def test_one_tensor_with_two_dtypes_is_named(channel, fuzz_member) -> None:
    a = _tensor("w", [8, 8], "float32", [[(0, 4), (0, 8)]])
    b = _tensor("w", [8, 8], "bfloat16", [[(4, 8), (0, 8)]])
    exc = _publish(channel, fuzz_member, [a, b])
    assert exc is not None
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(exc.trailing_metadata())["refit-field"] == "layout.tensors[1].spec.dtype"


def _layout(n: int, *, dtype: str = "bfloat16", rows: int = 4) -> Any:
    builder = LayoutBuilder()
    for i in range(n):
        spec = TensorSpec.create(f"model.layers.{i // 8}.w{i % 8}.weight", [rows, 8], dtype)
        builder.add(spec, 0, ((0, rows), (0, 8)))
    return builder.build()


def test_twenty_thousand_tensors(world: World, channel, fuzz_member, sim_cluster) -> None:
    big = [_tensor(f"t{i}", [4, 8], "bfloat16", [[(0, 4), (0, 8)]]) for i in range(20_000)]
    started = time.monotonic()
    assert _publish(channel, fuzz_member, big) is None
    accepted_s = time.monotonic() - started
    bad = [*big[:-1], _tensor("t19999", [4, 8], "bfloat16", [[(0, 5), (0, 8)]])]
    exc = _publish(channel, fuzz_member, bad)
    assert exc is not None
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(exc.trailing_metadata())["refit-field"] == "layout.tensors[19999].boxes[0]"
    assert accepted_s < 10, accepted_s

    # And a refit of 20,000 tensors plans and commits (simulated agents: no bytes move).
    cluster = sim_cluster(world.cluster.coordinator, job="big-job")
    layout = _layout(20_000)
    cluster.add(Role.TRAINER, layout=layout)
    cluster.add(Role.GENERATOR, replica="a", layout=layout)
    with cluster.client() as client:
        started = time.monotonic()
        final = client.wait(client.trigger("big-job").refit_id, timeout_s=60)
    assert final.state is RefitState.COMMITTED, (final.reason, final.message)
    print(
        f"20k tensors: layout accepted in {accepted_s:.2f} s, refit {time.monotonic() - started:.2f} s"
    )


@pytest.mark.parametrize(
    ("generator_layout", "named"),
    [(_layout(3, dtype="float32"), "float32"), (_layout(3, rows=8), "[8, 8]")],
    ids=["dtype", "shape"],
)
def test_trainer_and_generator_disagree(world: World, sim_cluster, generator_layout, named) -> None:
    job = f"mismatch-{named.strip('[]').replace(', ', 'x')}"
    cluster = sim_cluster(world.cluster.coordinator, job=job)
    trainer = cluster.add(Role.TRAINER, layout=_layout(3))
    generator = cluster.add(Role.GENERATOR, replica="a", layout=generator_layout)
    with cluster.client() as client:
        final = client.wait(client.trigger(job).refit_id, timeout_s=30)
    assert final.state is RefitState.FAILED
    assert final.reason == "INVALID_LAYOUT", (final.reason, final.message)
    assert "model.layers.0.w0.weight" in final.message
    assert named in final.message
    # Nothing was sent to anyone: the replica keeps serving what it has.
    for member in (trainer, generator):
        assert isinstance(member.agent, SimulatedAgent)
        assert not member.agent.commands, member.agent.commands


# --- REST -------------------------------------------------------------------------------------------


@pytest.fixture
def api_schema(world: World) -> Any:
    return schemathesis.openapi.from_url(f"{world.cluster.coordinator.http_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_rest_schema_fuzz_never_errors(case: Any) -> None:
    response = call_and_validate(case)
    assert response.status_code < 500


# --- still serving ----------------------------------------------------------------------------------


def test_still_serving_after_all_of_it(world: World, channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"{world.cluster.coordinator.http_url}/readyz", timeout=5).status_code == 200
    with world.cluster.client() as client:
        world.version = max(r.version for r in client.list(world.cluster.job, limit=1000))
    world.commit()
    log = world.cluster.coordinator.log()
    assert world.cluster.coordinator.starts == 1, "the coordinator restarted"
    assert "Traceback" not in log, log[-3000:]
    assert "unexpected error" not in log, log[-3000:]
