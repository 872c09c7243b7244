"""Which transport each link of a group uses, from where its two ends run.

A member says where it runs when it registers: its device ("cpu", "cuda:N"), the physical
machine (`node`) and its GPU's UUID. For a link (source group rank → destination group rank):

- both on one GPU (same `device_uuid`): CUDA IPC — NCCL refuses two ranks on one GPU, and
  the bytes only need a device-local copy (the colocated deployment: vLLM sleeps while the
  trainer steps on the same GPU);
- two GPUs of one node: `same_host` decides — "ipc" (the receiver maps the sender's buffers
  and copies over NVLink/PCIe with the copy engines), "nccl" (NCCL P2P), or "auto" (what was
  measured faster: `SAME_HOST_AUTO`);
- different nodes, or a node nobody named: NCCL.

A group runs one backend (one set of communicators for every link), so the group takes CUDA
IPC when every link chose it and every rank is on one node, NCCL otherwise — except that
two ranks on one GPU rule NCCL out: such a group runs CUDA IPC if it stays on one node (its
cross-GPU links too) and cannot be formed if it does not (the error names both pairs).
CPU groups are Gloo, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from refitplane.errors import InvalidArgument
from refitplane.protocol.enums import Backend

SameHost = Literal["auto", "ipc", "nccl"]
SAME_HOST_CHOICES: tuple[SameHost, ...] = ("auto", "ipc", "nccl")
# Two GPUs of one node under `same_host="auto"`. NCCL P2P until the IPC path is measured
# faster on the same pair (benchmarks/ipc_refit.py; BENCHMARKS.md).
SAME_HOST_AUTO = Backend.NCCL


@dataclass(frozen=True)
class Placement:
    """Where one group rank runs, as it registered."""

    device: str
    node: str = ""
    device_uuid: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def same_gpu(self, other: Placement) -> bool:
        return bool(self.device_uuid) and self.device_uuid == other.device_uuid

    def same_node(self, other: Placement) -> bool:
        return self.same_gpu(other) or (bool(self.node) and self.node == other.node)

    def describe(self) -> str:
        where = self.node or "?"
        gpu = f" {self.device_uuid}" if self.device_uuid else ""
        return f"{self.device} on {where}{gpu}"


Link = tuple[int, int]


def link_transport(src: Placement, dst: Placement, same_host: SameHost = "auto") -> Backend:
    """The transport one link would use on its own (see the module's docstring)."""
    if same_host not in SAME_HOST_CHOICES:
        raise InvalidArgument(
            f"same-host transport must be one of {', '.join(SAME_HOST_CHOICES)}, got {same_host!r}",
            field="same_host_transport",
        )
    if not (src.on_gpu and dst.on_gpu):
        return Backend.GLOO
    if src.same_gpu(dst):
        return Backend.CUDA_IPC
    if src.same_node(dst):
        if same_host == "ipc":
            return Backend.CUDA_IPC
        if same_host == "nccl":
            return Backend.NCCL
        return SAME_HOST_AUTO
    return Backend.NCCL


@dataclass(frozen=True)
class GroupTransports:
    """The backend a group runs and what each link would have chosen on its own."""

    backend: Backend
    links: dict[Link, Backend]

    def effective(self) -> dict[Link, Backend]:
        """What each link actually uses: the group's one backend."""
        return dict.fromkeys(self.links, self.backend)


def group_transports(
    placements: Sequence[Placement],
    links: Iterable[Link],
    same_host: SameHost = "auto",
    *,
    names: Sequence[str] | None = None,
) -> GroupTransports:
    """Choose the group's backend for `placements` (indexed by group rank) and its links.

    `names` (by group rank) only serve error messages. Raises `InvalidArgument` when the
    members mix CPU and GPU, or when two ranks share a GPU (CUDA IPC required) and the
    group also spans nodes."""

    def name(rank: int) -> str:
        return names[rank] if names is not None else f"group rank {rank}"

    gpus = {p.on_gpu for p in placements}
    if len(gpus) > 1:
        raise InvalidArgument(
            "members mix cpu and cuda devices; one group needs one backend", field="device"
        )
    chosen = {
        (s, d): link_transport(placements[s], placements[d], same_host) for s, d in sorted(links)
    }
    if gpus == {False} or not placements:
        return GroupTransports(Backend.GLOO, chosen)
    spread = _spans_nodes(placements)
    if spread is None and chosen and all(b is Backend.CUDA_IPC for b in chosen.values()):
        return GroupTransports(Backend.CUDA_IPC, chosen)
    shared = _shared_gpu(placements)
    if shared is None:
        return GroupTransports(Backend.NCCL, chosen)
    if spread is None:
        # NCCL refuses two ranks on one GPU: the whole node's group goes over CUDA IPC,
        # the cross-GPU links too, whatever `same_host` prefers.
        return GroupTransports(Backend.CUDA_IPC, chosen)
    (a, b), (c, d) = shared, spread
    raise InvalidArgument(
        f"{name(a)} and {name(b)} share GPU {placements[a].device_uuid}, which only CUDA IPC "
        f"can serve (NCCL refuses two ranks on one GPU), but {name(c)} "
        f"({placements[c].describe()}) and {name(d)} ({placements[d].describe()}) are not on "
        "one node; run colocated groups on one node",
        field="device_uuid",
    )


def _spans_nodes(placements: Sequence[Placement]) -> Link | None:
    """Two ranks not on one node (None: every rank on the first one's node)."""
    first = placements[0]
    for i, p in enumerate(placements[1:], start=1):
        if not p.same_node(first):
            return (0, i)
    return None


def _shared_gpu(placements: Sequence[Placement]) -> Link | None:
    seen: dict[str, int] = {}
    for i, p in enumerate(placements):
        if not p.device_uuid:
            continue
        if p.device_uuid in seen:
            return (seen[p.device_uuid], i)
        seen[p.device_uuid] = i
    return None
