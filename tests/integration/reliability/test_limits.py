"""No single request takes the coordinator down or freezes it (issue 22, section 2), with a
real coordinator process on a real Redis:

* a 128 MiB JSON body without a token gets 401 from the headers, never read; with the token
  it gets 413 naming REFIT_HTTP_MAX_BODY_BYTES (from Content-Length, or mid-stream for a
  chunked body); a 400 MiB gRPC message is refused from its length prefix — all while the
  coordinator runs under an address-space limit equal to the chart's default memory limit
  (1 GiB) and its peak RSS stays within 64 MiB of where it started;
* one tensor split into 20,000 one-row boxes validates (a sweep, in a worker thread) while
  `/healthz` keeps answering; one box more than REFIT_MAX_BOXES_PER_TENSOR is refused
  naming the setting; an overlap among 20,000 boxes is named by its path;
* a layout larger than one message (REFIT_GRPC_MAX_RECEIVE_BYTES) is published in chunks
  by the real agent session and put together again (same digest);
* REST `version` takes only JSON integers.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from refitplane._generated.refit.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from refitplane.protocol import Role
from refitplane.protocol.channel import member_metadata
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.testing.cluster.proc_cluster import ProcCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "tok-limits-5b1e0c7d9a2f4e68"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MiB = 1 << 20
# deploy/helm/refit-coordinator/values.yaml: resources.limits.memory (checked below).
CHART_MEMORY_LIMIT = 1 << 30
VALUES = Path(__file__).parents[3] / "deploy/helm/refit-coordinator/values.yaml"
# The coordinator process, with its address space capped (a tighter bound than a cgroup's
# resident limit: what is mapped but never touched counts too). Few malloc arenas, so the
# cap measures what the process uses, not what glibc reserves per thread.
_LIMITED = (
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_AS, ({CHART_MEMORY_LIMIT}, {CHART_MEMORY_LIMIT})); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcCluster]:
    assert "memory: 1Gi" in VALUES.read_text(), "the chart's default memory limit changed"
    c = ProcCluster(
        tmp_path_factory.mktemp("limits"),
        token=TOKEN,
        coordinator_env={"MALLOC_ARENA_MAX": "2", "REFIT_LEASE_TTL_S": "30"},
    )
    argv = c.coordinator.argv
    c.coordinator.argv = [argv[0], "-c", _LIMITED, *argv[1:]]
    with c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster: ProcCluster) -> Iterator[agent_pb2_grpc.AgentServiceStub]:
    with grpc.insecure_channel(cluster.coordinator.grpc_target) as channel:
        yield agent_pb2_grpc.AgentServiceStub(channel)


def _register(stub: agent_pb2_grpc.AgentServiceStub, job: str) -> tuple[str, Any]:
    """A trainer of `job`: its member id and the metadata its later calls carry."""
    reply = stub.Register(
        agent_pb2.RegisterRequest(
            job=job, role=common_pb2.ROLE_TRAINER, world_size=1, device="cpu"
        ),
        metadata=AUTH,
        timeout=10,
    )
    return str(reply.member_id), member_metadata(TOKEN, reply.member_credential)


def _raw_post(url: str, path: str, length: int, send: int, headers: str = "") -> tuple[int, str]:
    """POST `send` bytes of a JSON body that claims `length` bytes (or, with length 0,
    `send` bytes chunked); the status and body the server answers, read as soon as it does.
    The body streams from a thread, so an early answer is read while the client is still
    sending (and whatever the server does not read is simply never sent)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    framing = f"Content-Length: {length}" if length else "Transfer-Encoding: chunked"
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"{headers}{framing}\r\n\r\n".encode()
    )

    def stream() -> None:
        piece = b'{"target_replicas": [' + b'"a",' * (MiB // 4)
        sent = 0
        try:
            while sent < send:
                chunk = piece[: min(len(piece), send - sent)]
                sock.sendall(chunk if length else b"%x\r\n%b\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed: the rest is never sent

    sender = threading.Thread(target=stream, daemon=True)
    sender.start()
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < 20:
        data = sock.recv(65536)
        if not data:
            break
        reply += data
    sock.close()
    sender.join(timeout=30)
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_huge_bodies_are_refused_unread(cluster: ProcCluster, stub) -> None:
    coordinator = cluster.coordinator
    url = coordinator.http_url
    peak_before = _peak_rss_kib(coordinator.pid)

    # 128 MiB without a token: 401 from the headers.
    status, body = _raw_post(url, "/v1/jobs/j/refits", 128 * MiB, 128 * MiB)
    assert status == 401, body
    assert "bearer token" in body
    # With the token: 413 naming the cap, from Content-Length alone ...
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    status, body = _raw_post(url, "/v1/jobs/j/refits", 128 * MiB, 128 * MiB, auth)
    assert status == 413, body
    assert "REFIT_HTTP_MAX_BODY_BYTES (1048576 bytes)" in json.loads(body)["error"]["message"]
    # ... and mid-stream when the body is chunked (no length to go by).
    status, body = _raw_post(url, "/v1/jobs/j/refits", 0, 128 * MiB, auth)
    assert status == 413, body

    # A 400 MiB gRPC message, no token: refused from its length prefix.
    huge = b"\x0a" + bytes(400 * MiB)
    options = [("grpc.max_send_message_length", 512 * MiB)]
    with grpc.insecure_channel(coordinator.grpc_target, options=options) as channel:
        publish = channel.unary_unary(
            "/refit.v1.AgentService/PublishLayout",
            request_serializer=lambda raw: raw,
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.RpcError) as caught:
            publish(huge, timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value

    # Alive, answering, and it never held any of it.
    assert coordinator.alive()
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    assert _register(stub, "after-huge-bodies")
    grown_mib = (_peak_rss_kib(coordinator.pid) - peak_before) / 1024
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.0f} MiB"
    print(f"[reliability] huge bodies: peak RSS +{grown_mib:.1f} MiB under RLIMIT_AS 1 GiB")


@pytest.mark.parametrize("bad", [True, "12", 13.0, -1, None])
def test_version_must_be_an_integer(cluster: ProcCluster, bad: Any) -> None:
    response = httpx.post(
        f"{cluster.coordinator.http_url}/v1/jobs/nojob/refits",
        json={"version": bad},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == "version", error
    # An integer gets past the body checks (to the job check).
    good = httpx.post(
        f"{cluster.coordinator.http_url}/v1/jobs/nojob/refits",
        json={"version": 12},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert good.status_code == 404, good.text


def _rows(n: int, *, overlap: bool = False) -> common_pb2.RankLayout:
    """One tensor of n rows, one box per row (the last overlapping the first if asked)."""
    boxes = [common_pb2.Box(start=[r, 0], stop=[r + 1, 16]) for r in range(n)]
    if overlap:
        boxes[-1] = common_pb2.Box(start=[0, 0], stop=[2, 16])
    spec = common_pb2.TensorSpec(name="model.embed_tokens.weight", shape=[n, 16], dtype="bfloat16")
    return common_pb2.RankLayout(tensors=[common_pb2.TensorBoxes(spec=spec, boxes=boxes)])


def test_twenty_thousand_boxes_validate_while_healthz_answers(cluster: ProcCluster, stub) -> None:
    member, metadata = _register(stub, "many-boxes")
    outcome: list[Any] = []

    def publish() -> None:
        try:
            outcome.append(
                stub.PublishLayout(
                    agent_pb2.PublishLayoutRequest(member_id=member, layout=_rows(20_000)),
                    metadata=metadata,
                    timeout=120,
                )
            )
        except grpc.RpcError as exc:
            outcome.append(exc)

    publisher = threading.Thread(target=publish)
    publisher.start()
    answered = 0
    with httpx.Client(base_url=cluster.coordinator.http_url, timeout=10) as http:
        while publisher.is_alive() or not answered:
            assert http.get("/healthz").status_code == 200
            answered += 1
    publisher.join()
    reply = outcome[0]
    assert isinstance(reply, agent_pb2.PublishLayoutResponse), reply
    assert reply.num_tensors == 1
    assert reply.layout_digest

    with pytest.raises(grpc.RpcError) as caught:
        stub.PublishLayout(
            agent_pb2.PublishLayoutRequest(member_id=member, layout=_rows(20_000, overlap=True)),
            metadata=metadata,
            timeout=120,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailers = dict(caught.value.trailing_metadata() or ())
    assert trailers["refit-field"] == "layout.tensors[0].boxes[19999]", trailers
    assert "overlaps box [0:1, 0:16]" in (caught.value.details() or "")

    # One box more than the cap (32,768 by default): refused, the setting named.
    with pytest.raises(grpc.RpcError) as caught:
        stub.PublishLayout(
            agent_pb2.PublishLayoutRequest(member_id=member, layout=_rows(32_769)),
            metadata=metadata,
            timeout=120,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "REFIT_MAX_BOXES_PER_TENSOR" in (caught.value.details() or "")
    print(f"[reliability] 20,000-box layout: /healthz answered {answered} times meanwhile")


def _many_tensors(n: int) -> Any:
    builder = LayoutBuilder()
    for i in range(n):
        spec = TensorSpec.create(f"model.layers.{i // 8}.w{i % 8}.weight", [4, 8], "bfloat16")
        builder.add(spec, 0, ((0, 4), (0, 8)))
    return builder.build()


def test_large_layouts_are_published_in_chunks(cluster: ProcCluster, sim_cluster) -> None:
    from refitplane.protocol import convert

    layout = _many_tensors(80_000)
    size = convert.layout_to_proto(layout, 0).ByteSize()
    assert size > 4 * MiB, size  # above the coordinator's message limit: one message fails
    sims = sim_cluster(cluster.coordinator, job="chunked", token=TOKEN)
    trainer = sims.add(Role.TRAINER, layout=layout)
    # The coordinator put the chunks together into the very same layout.
    with sims.client() as client:
        members = client.topology("chunked").members
    assert [m.layout_digest for m in members] == [layout.digest]
    assert trainer.session.publish_layout(layout) == layout.digest
    print(f"[reliability] a {size / MiB:.1f} MiB layout went in chunks, digest intact")
