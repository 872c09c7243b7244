"""The gRPC edge: auth on mutating calls, malformed requests → INVALID_ARGUMENT naming the
field, grpc.health.v1 and server reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc, orchestrator_pb2_grpc
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane._generated.refit.v1 import orchestrator_pb2 as opb
from refitplane.errors import Unauthenticated
from refitplane.protocol import RefitState
from refitplane.protocol.channel import member_metadata

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-value"


def _trailers(err: grpc.RpcError) -> dict[str, str]:
    return dict(err.trailing_metadata() or ())


@pytest.fixture
def channel(coordinator):
    with grpc.insecure_channel(coordinator.grpc_target) as ch:
        yield ch


@pytest.fixture
def agents(channel):
    return agent_pb2_grpc.AgentServiceStub(channel)


def _register(agents, **fields):
    request = {
        "job": "job",
        "role": cpb.ROLE_TRAINER,
        "rank": 0,
        "world_size": 1,
        "device": "cpu",
        **fields,
    }
    return agents.Register(apb.RegisterRequest(**request), timeout=5)


def _as(reply):
    """The metadata that proves to be the member `reply` registered."""
    return member_metadata(None, reply.member_credential)


def test_auth_required_on_mutating_calls_only(coordinator_factory, sim_cluster):
    coord = coordinator_factory(auth_token=TOKEN)
    with grpc.insecure_channel(coord.grpc_target) as ch:
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        refits = orchestrator_pb2_grpc.RefitServiceStub(ch)
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
            with pytest.raises(grpc.RpcError) as err:
                agents.Register(
                    apb.RegisterRequest(job="job", role=cpb.ROLE_TRAINER, world_size=1),
                    metadata=metadata,
                    timeout=5,
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (err.value.details() or "")
            with pytest.raises(grpc.RpcError) as err:
                refits.TriggerRefit(
                    opb.TriggerRefitRequest(job="job"), metadata=metadata, timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Reads are open; an unknown job is simply not found.
        with pytest.raises(grpc.RpcError) as err:
            refits.GetTopology(opb.GetTopologyRequest(job="job"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # With the token, agents and clients work end to end.
    cluster = sim_cluster(coord, token=TOKEN)
    cluster.trainers(world=1)
    cluster.replica("a")
    client = cluster.client()
    assert client.wait(client.trigger("job").refit_id, timeout_s=15).state is RefitState.COMMITTED
    from refitplane.client import RefitClient

    with RefitClient(coord.grpc_target) as anonymous, pytest.raises(Unauthenticated):
        anonymous.trigger("job")


def test_undecodable_request_is_invalid_argument(channel):
    call = channel.unary_unary(
        "/refit.v1.AgentService/Register",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as err:
        call(b"\xff\xff\xff\xff garbage", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _trailers(err.value)["refit-field"] == "request"
    assert "Register request" in err.value.details()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"job": ""}, "job"),
        ({"job": "has space"}, "job"),
        ({"role": cpb.ROLE_UNSPECIFIED}, "role"),
        ({"role": 42}, "role"),
        ({"rank": 3, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"device": "tpu:0"}, "device"),
        ({"replica_id": "r0"}, "replica_id"),
        ({"role": cpb.ROLE_GENERATOR}, "replica_id"),
        ({"labels": {"bad key!": "x"}}, "labels"),
        ({"version": 10**15}, "version"),
    ],
)
def test_malformed_registration_names_the_field(agents, fields, field):
    with pytest.raises(grpc.RpcError) as err:
        _register(agents, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _trailers(err.value)["refit-field"] == field
    assert field in err.value.details()


def _tensor(name="w", shape=(8, 4), dtype="float32", boxes=(((0, 8), (0, 4)),)):
    return cpb.TensorBoxes(
        spec=cpb.TensorSpec(name=name, shape=list(shape), dtype=dtype),
        boxes=[cpb.Box(start=[a for a, _ in b], stop=[z for _, z in b]) for b in boxes],
    )


@pytest.mark.parametrize(
    ("tensors", "field", "named"),
    [
        ([_tensor(shape=(-1, 4))], "layout.tensors[0].spec.shape", "dimension 0"),
        ([_tensor(shape=(1 << 41, 4))], "layout.tensors[0].spec.shape", "dimension 0"),
        ([_tensor(dtype="float128")], "layout.tensors[0].spec.dtype", "float128"),
        ([_tensor(name="")], "layout.tensors[0].spec.name", "name"),
        ([_tensor(boxes=(((0, 9), (0, 4)),))], "layout.tensors[0].boxes[0]", "[0:9, 0:4]"),
        ([_tensor(boxes=(((0, 8),),))], "layout.tensors[0].boxes[0]", "out of range"),
        (
            [_tensor(boxes=(((0, 6), (0, 4)), ((4, 8), (0, 4))))],
            "layout.tensors[0].boxes[1]",
            "overlaps",
        ),
        ([_tensor(), _tensor(dtype="bfloat16")], "layout.tensors[1].spec.dtype", "float32"),
        ([_tensor(boxes=())], "layout.tensors[0].boxes", "no boxes"),
        ([cpb.TensorBoxes()], "layout.tensors[0].spec", "spec"),
    ],
)
def test_malformed_layouts_name_the_field(agents, tensors, field, named):
    reply = _register(agents)
    member = reply.member_id
    request = apb.PublishLayoutRequest(member_id=member, layout=cpb.RankLayout(tensors=tensors))
    with pytest.raises(grpc.RpcError) as err:
        agents.PublishLayout(request, timeout=5, metadata=_as(reply))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _trailers(err.value)["refit-field"] == field
    assert named in err.value.details()
    box_mismatch = cpb.Box(start=[0, 0], stop=[8])
    bad = apb.PublishLayoutRequest(
        member_id=member,
        layout=cpb.RankLayout(
            tensors=[
                cpb.TensorBoxes(
                    spec=cpb.TensorSpec(name="w", shape=[8, 4], dtype="float32"),
                    boxes=[box_mismatch],
                )
            ]
        ),
    )
    with pytest.raises(grpc.RpcError) as err:
        agents.PublishLayout(bad, timeout=5, metadata=_as(reply))
    assert _trailers(err.value)["refit-field"] == "layout.tensors[0].boxes[0]"


def test_unknown_member_and_report_without_body(agents):
    with pytest.raises(grpc.RpcError) as err:
        agents.RenewLease(
            apb.RenewLeaseRequest(member_id="nobody"),
            timeout=5,
            metadata=member_metadata(None, "some-credential"),
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _trailers(err.value)["refit-field"] == "member_id"
    reply = _register(agents)
    member = reply.member_id
    with pytest.raises(grpc.RpcError) as err:
        agents.Report(apb.ReportRequest(member_id=member), timeout=5, metadata=_as(reply))
    assert _trailers(err.value)["refit-field"] == "report"
    # A report for a refit that is not running is answered, but not accepted.
    stale = agents.Report(
        apb.ReportRequest(member_id=member, refit_id="old", prepared=apb.Prepared()),
        timeout=5,
        metadata=_as(reply),
    )
    assert stale.accepted is False


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "refit.v1.RefitService", "refit.v1.AgentService"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"refit.v1.RefitService", "refit.v1.AgentService", "grpc.health.v1.Health"} <= names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= (
        names
    )


def test_reflection_v1_answers_like_v1alpha(channel):
    """grpcurl asks grpc.reflection.v1 first: the same messages under the v1 service name."""
    v1 = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (listed, described) = list(
        v1(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="refit.v1.RefitService"
                    ),
                ]
            ),
            timeout=5,
        )
    )
    assert "refit.v1.RefitService" in {s.name for s in listed.list_services_response.service}
    files = described.file_descriptor_response.file_descriptor_proto
    assert any(b"TriggerRefit" in f for f in files)


_text = st.text(max_size=40)
_registrations = st.builds(
    apb.RegisterRequest,
    job=_text,
    role=st.integers(min_value=0, max_value=5),
    replica_id=_text,
    rank=st.integers(min_value=0, max_value=2**32 - 1),
    world_size=st.integers(min_value=0, max_value=2**32 - 1),
    host=_text,
    device=_text,
    labels=st.dictionaries(_text, _text, max_size=3),
    version=st.integers(min_value=0, max_value=2**64 - 1),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request=_registrations)
def test_fuzzed_registrations_never_crash_the_server(agents, request):
    failure: grpc.RpcError | None = None
    try:
        agents.Register(request, timeout=5)
    except grpc.RpcError as exc:
        failure = exc
    if failure is not None:
        allowed = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert failure.code() in allowed, failure.details()
        assert "refit-field" in _trailers(failure)
