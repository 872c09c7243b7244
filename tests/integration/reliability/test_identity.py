"""Identity (issue 22 §1), every part a real process: a coordinator with a shared token on
Redis, one trainer rank and two one-rank generator replicas over Gloo.

The forger holds the shared token — every trainer pod, vLLM pod and orchestrator has it —
and reads the participants' member ids from the open topology. Expected: every call it
makes in a member's name (TransferDone with nothing verified, a refit or group Failure,
StreamCommands, lease renewal, layout publish, deregister) is refused UNAUTHENTICATED
without a member credential and PERMISSION_DENIED with a wrong one; the refit it tried to
commit early goes on untouched and commits with the trainers' bytes in every generator;
the group epoch is not poisoned. A real agent whose TransferDone contradicts its plan
(nothing moved, nothing verified) fails the refit with REPORT_MISMATCH; nothing commits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.protocol import MemberState, RefitState
from refitplane.protocol.channel import MEMBER_CREDENTIAL_KEY, auth_metadata
from refitplane.testing.cluster.proc_cluster import ProcCluster
from tests.integration.reliability.conftest import FAULT_ENV
from tests.integration.reliability.support import World, note

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "tok-identity-5d1c0e9a7b3f4a2e8c6d"
# Long enough that the forger's calls all land while the transfer is held back.
TRANSFER_DELAY_S = 4.0
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cluster = ProcCluster(
        tmp_path_factory.mktemp("identity"),
        coordinator_env={**FAULT_ENV, "REFIT_TRANSFER_TIMEOUT_S": "30"},
        token=TOKEN,
    )
    try:
        cluster.start()
        cluster.add_trainers(1)
        cluster.add_replica("rep-0", 1)
        cluster.add_replica("rep-1", 1)
        cluster.wait_ready()
        w = World(cluster)
        w.commit()
        yield w
    finally:
        cluster.close()


def _forgeries(member_id: str, refit_id: str, epoch: int) -> list[tuple[str, Any]]:
    """Every member-scoped call, in `member_id`'s name."""
    return [
        (
            "Report",
            apb.ReportRequest(
                member_id=member_id,
                refit_id=refit_id,
                transfer_done=apb.TransferDone(tensors_verified=0, tensors_total=0),
            ),
        ),
        (
            "Report",
            apb.ReportRequest(
                member_id=member_id,
                refit_id=refit_id,
                failure=apb.Failure(reason="PEER_FAILED", message="forged"),
            ),
        ),
        # A group-scoped Failure: would poison the healthy epoch.
        (
            "Report",
            apb.ReportRequest(
                member_id=member_id, failure=apb.Failure(reason="GROUP_FAILED", epoch=epoch)
            ),
        ),
        ("RenewLease", apb.RenewLeaseRequest(member_id=member_id)),
        (
            "PublishLayout",
            apb.PublishLayoutRequest(member_id=member_id, layout=cpb.RankLayout()),
        ),
        ("Deregister", apb.DeregisterRequest(member_id=member_id)),
    ]


def _code(call: Any, request: Any, metadata: Any) -> grpc.StatusCode:
    try:
        call(request, metadata=metadata, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _stream_code(stub: Any, member_id: str, metadata: Any) -> grpc.StatusCode:
    """Open StreamCommands as `member_id`; what the first read ends with."""
    call = stub.StreamCommands(
        apb.StreamCommandsRequest(member_id=member_id), metadata=metadata, timeout=2
    )
    try:
        next(iter(call))
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        call.cancel()
    return grpc.StatusCode.OK  # it was handed the victim's command


def test_shared_token_cannot_act_as_a_member(world: World) -> None:
    cluster = world.cluster
    epoch = cluster.topology().group_epoch
    trainer = cluster.trainers[0]
    trainer.arm(delay_s=TRANSFER_DELAY_S)
    version = world.next_version()
    world.step(version)
    refit = world.trigger(version)
    cluster.wait_state(refit.refit_id, RefitState.TRANSFERRING)
    victims = [m.member_id for m in cluster.topology().members]
    assert len(victims) == 3
    token_only = auth_metadata(TOKEN)
    guessed = (*token_only, (MEMBER_CREDENTIAL_KEY, "guessed-credential"))
    codes: dict[str, set[grpc.StatusCode]] = {}

    def refused(stub: Any, metadata: Any) -> None:
        for victim in victims:
            for method, request in _forgeries(victim, refit.refit_id, epoch):
                code = _code(getattr(stub, method), request, metadata)
                codes.setdefault(method, set()).add(code)
                assert code in REFUSED, (method, victim, code)
            code = _stream_code(stub, victim, metadata)
            codes.setdefault("StreamCommands", set()).add(code)
            assert code in REFUSED, ("StreamCommands", victim, code)

    with grpc.insecure_channel(cluster.coordinator.grpc_target) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        refused(stub, token_only)
        refused(stub, guessed)
        # A valid credential of the forger's own (it may register: it holds the token) is
        # no one else's either.
        own = stub.Register(
            apb.RegisterRequest(
                job=cluster.job,
                role=cpb.ROLE_GENERATOR,
                replica_id="forger",
                world_size=1,
                device="cpu",
            ),
            metadata=token_only,
            timeout=5,
        )
        borrowed = (*token_only, (MEMBER_CREDENTIAL_KEY, own.member_credential))
        refused(stub, borrowed)
        stub.Deregister(
            apb.DeregisterRequest(member_id=own.member_id), metadata=borrowed, timeout=5
        )
    # The refit went on untouched: it commits with the real bytes, on the same epoch.
    final = cluster.wait(refit.refit_id, timeout_s=60)
    assert final.state is RefitState.COMMITTED, (final.reason, final.message)
    assert final.group_epoch == epoch
    world.check_holds(version)
    assert all(m.state is MemberState.READY for m in cluster.topology().members)
    note(
        "test_shared_token_cannot_act_as_a_member",
        victims=len(victims),
        refused={k: sorted(c.name for c in v) for k, v in codes.items()},
    )


def test_report_that_contradicts_the_plan_fails_the_refit(world: World) -> None:
    cluster = world.cluster
    liar = cluster.generators[0]
    liar.arm(misreport_done=1)
    version = world.next_version()
    world.step(version)
    final = cluster.wait(world.trigger(version).refit_id, timeout_s=60)
    assert final.state is RefitState.FAILED, final
    assert final.reason == "REPORT_MISMATCH", (final.reason, final.message)
    assert liar.status()["member_id"] in final.message
    assert "tensors_total 0" in final.message
    assert liar.status()["faults"]["misreports"] == 1
    # Nothing was committed: the coordinator shows no replica at the failed version.
    for replica in cluster.topology().replicas:
        assert replica.version < version, replica
    world.commit()
    note("test_report_that_contradicts_the_plan_fails_the_refit", message=final.message)
