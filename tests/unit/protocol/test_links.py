"""Transport per link and per group from where members run (simulated hosts and GPUs)."""

from __future__ import annotations

import pytest

from refitplane.errors import InvalidArgument
from refitplane.protocol import Backend
from refitplane.protocol.links import Placement, group_transports, link_transport

pytestmark = pytest.mark.unit

A0 = Placement("cuda:0", "node-a", "GPU-a0")
A0_OTHER_PROCESS = Placement("cuda:0", "node-a", "GPU-a0")
A1 = Placement("cuda:1", "node-a", "GPU-a1")
# Same node, the GPU seen as cuda:0 by another process (CUDA_VISIBLE_DEVICES differ).
A1_AS_0 = Placement("cuda:0", "node-a", "GPU-a1")
B0 = Placement("cuda:0", "node-b", "GPU-b0")
CPU = Placement("cpu", "node-a")


def test_one_link():
    assert link_transport(A0, A0_OTHER_PROCESS, "nccl") is Backend.CUDA_IPC
    # Device indices mean nothing across processes: the UUIDs decide.
    assert link_transport(A0, A1_AS_0, "ipc") is Backend.CUDA_IPC
    assert link_transport(A0, A1_AS_0, "nccl") is Backend.NCCL
    assert link_transport(A0, A1, "auto") is Backend.NCCL
    assert link_transport(A0, B0, "ipc") is Backend.NCCL
    assert link_transport(CPU, CPU) is Backend.GLOO
    with pytest.raises(InvalidArgument) as err:
        link_transport(A0, A1, "shm")  # type: ignore[arg-type]
    assert err.value.field == "same_host_transport"


def test_group_takes_ipc_only_when_every_link_does():
    one_node = group_transports([A0, A1, A0_OTHER_PROCESS], [(0, 2), (1, 2)], "ipc")
    assert one_node.backend is Backend.CUDA_IPC
    assert one_node.effective() == {(0, 2): Backend.CUDA_IPC, (1, 2): Backend.CUDA_IPC}
    # One link leaves the node: the group is NCCL, the same-node link too.
    mixed = group_transports([A0, B0, A1], [(0, 2), (1, 2)], "ipc")
    assert mixed.backend is Backend.NCCL
    assert mixed.links == {(0, 2): Backend.CUDA_IPC, (1, 2): Backend.NCCL}
    assert mixed.effective() == {(0, 2): Backend.NCCL, (1, 2): Backend.NCCL}
    assert group_transports([CPU, CPU], [(0, 1)]).backend is Backend.GLOO


def test_shared_gpu_across_nodes_names_both_pairs():
    with pytest.raises(InvalidArgument) as err:
        group_transports(
            [A0, B0, A0_OTHER_PROCESS, Placement("cuda:1", "node-b", "GPU-b1")],
            [(0, 2), (1, 3)],
            names=["trainer 0", "trainer 1", "vllm a", "vllm b"],
        )
    msg = err.value.message
    assert "trainer 0 and vllm a share GPU GPU-a0" in msg
    assert "trainer 1 (cuda:0 on node-b GPU-b0)" in msg


def test_a_shared_gpu_puts_the_whole_node_on_ipc():
    # Colocated TP2: trainer r and vLLM rank r share GPU r; the plan also crosses GPUs.
    placements = [A0, A1, A0_OTHER_PROCESS, Placement("cuda:0", "node-a", "GPU-a1")]
    links = [(0, 2), (0, 3), (1, 2), (1, 3)]
    chosen = group_transports(placements, links, "nccl")
    assert chosen.backend is Backend.CUDA_IPC
    assert chosen.links[(0, 3)] is Backend.NCCL  # what it would take on its own
    assert set(chosen.effective().values()) == {Backend.CUDA_IPC}


def test_mixed_cpu_and_gpu_is_refused():
    with pytest.raises(InvalidArgument):
        group_transports([A0, CPU], [(0, 1)])
