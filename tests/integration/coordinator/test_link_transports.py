"""The coordinator picks the group's transport from where members registered (simulated
hosts and GPUs; real coordinator, real gRPC sessions): colocated ranks get CUDA IPC, the
same-host setting decides between two GPUs of one node, and a shared GPU in a group that
spans nodes fails the refit naming the ranks. `refitctl topology` shows it."""

from __future__ import annotations

import json
import os

import pytest

from refitplane.cli.refitctl import main
from refitplane.protocol import Role
from tests.integration.conftest import row_layout

pytestmark = pytest.mark.integration


def _gpu_member(cluster, role, node, gpu, *, rank=0, world=1, replica=""):
    return cluster.add(
        role,
        rank=rank,
        world=world,
        replica=replica,
        layout=row_layout(rank, world),
        device="cuda:0",
        node=node,
        device_uuid=gpu,
    )


def _refit(cluster):
    client = cluster.client()
    return client.wait(client.trigger("job").refit_id, timeout_s=30)


def test_colocated_members_form_a_cuda_ipc_group(coordinator, sim_cluster, capsys, monkeypatch):
    cluster = sim_cluster(coordinator)
    _gpu_member(cluster, Role.TRAINER, "node-a", "GPU-aaaa-0")
    _gpu_member(cluster, Role.GENERATOR, "node-a", "GPU-aaaa-0", replica="a")
    refit = _refit(cluster)
    assert refit.state.value == "COMMITTED", refit.message
    topo = cluster.client().topology("job")
    assert topo.backend is not None
    assert topo.backend.value == "CUDA_IPC"
    assert {(m.node, m.device_uuid) for m in topo.members} == {("node-a", "GPU-aaaa-0")}
    for key in list(os.environ):
        if key.startswith("REFIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("REFIT_COORDINATOR", coordinator.grpc_target)
    assert main(["topology", "--job", "job"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks, CUDA_IPC" in out
    assert "NODE" in out
    assert "GPU-aaaa-0" in out
    assert main(["topology", "--job", "job", "--json"]) == 0
    members = json.loads(capsys.readouterr().out)["members"]
    assert {m["device_uuid"] for m in members} == {"GPU-aaaa-0"}


@pytest.mark.parametrize(("same_host", "backend"), [("ipc", "CUDA_IPC"), ("nccl", "NCCL")])
def test_two_gpus_of_one_node_follow_the_setting(
    coordinator_factory, sim_cluster, same_host, backend
):
    coordinator = coordinator_factory(same_host_transport=same_host)
    cluster = sim_cluster(coordinator)
    _gpu_member(cluster, Role.TRAINER, "node-a", "GPU-aaaa-0")
    _gpu_member(cluster, Role.GENERATOR, "node-a", "GPU-aaaa-1", replica="a")
    assert _refit(cluster).state.value == "COMMITTED"
    assert cluster.client().topology("job").backend.value == backend


def test_a_shared_gpu_across_nodes_fails_naming_the_ranks(coordinator, sim_cluster):
    cluster = sim_cluster(coordinator)
    _gpu_member(cluster, Role.TRAINER, "node-a", "GPU-aaaa-0", rank=0, world=2)
    _gpu_member(cluster, Role.TRAINER, "node-b", "GPU-bbbb-0", rank=1, world=2)
    _gpu_member(cluster, Role.GENERATOR, "node-a", "GPU-aaaa-0", replica="a")
    refit = _refit(cluster)
    assert refit.state.value == "FAILED"
    assert refit.reason == "INVALID_TOPOLOGY"
    assert "share GPU GPU-aaaa-0" in refit.message
    assert "trainer rank 1" in refit.message
