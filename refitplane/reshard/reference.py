"""The golden reference path: gather each whole tensor on one holder, broadcast it whole.

This is the design most RL frameworks use today (and the baseline the executor must beat).
Here it serves tests: it shares nothing with the planner or the executor except the
transport, so agreement between the two is a meaningful cross-check. For every tensor,
in name order: the lowest source rank holding it is the root; one holder of each distinct
box sends that box to the root; the root sends the full tensor to every destination rank
that needs any of it; each destination copies its boxes out of the full tensor.
"""

from __future__ import annotations

import time

import torch

from refitplane.reshard.boxes import Box, to_slices
from refitplane.reshard.layout import Layout
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.transport.base import P2POp, Transport


def _send_recv(transport: Transport, op: P2POp, deadline: float) -> None:
    transport.wait(transport.fence(transport.issue(0, [op], deadline)), deadline)


def reference_refit(
    transport: Transport,
    source: Layout,
    target: Layout,
    shards: LocalShards,
    *,
    timeout_s: float = 120.0,
) -> None:
    """Run this rank's part of the broadcast refit of everything `target` needs."""
    rank = transport.rank
    deadline = time.monotonic() + timeout_s
    device = transport.device
    for t in target:
        spec = t.spec
        held = source.tensors[spec.name]
        root = min(held.boxes)
        dtype = torch_dtype(spec.dtype)
        full: torch.Tensor | None = None
        if rank == root:
            full = torch.empty(spec.shape, dtype=dtype, device=device)
        # Gather: one holder per distinct box.
        first_holder: dict[Box, int] = {}
        for r in sorted(held.boxes):
            for box in held.boxes[r]:
                first_holder.setdefault(box, r)
        for box, holder in sorted(first_holder.items(), key=lambda kv: (kv[1], kv[0])):
            if holder == root and rank == root:
                assert full is not None
                full[to_slices(box)] = shards.view(spec.name, box)
            elif rank == holder:
                data = shards.view(spec.name, box).contiguous()
                _send_recv(
                    transport, P2POp(True, root, data.reshape(-1).view(torch.uint8)), deadline
                )
            elif rank == root:
                assert full is not None
                part = torch.empty(tuple(b - a for a, b in box), dtype=dtype, device=device)
                _send_recv(
                    transport, P2POp(False, holder, part.reshape(-1).view(torch.uint8)), deadline
                )
                full[to_slices(box)] = part
        # Broadcast: the root sends the whole tensor to each destination rank.
        for dst in sorted(t.boxes):
            if rank == root:
                assert full is not None
                _send_recv(
                    transport, P2POp(True, dst, full.reshape(-1).view(torch.uint8)), deadline
                )
            elif rank == dst:
                whole = torch.empty(spec.shape, dtype=dtype, device=device)
                _send_recv(
                    transport, P2POp(False, root, whole.reshape(-1).view(torch.uint8)), deadline
                )
                for box in t.boxes[dst]:
                    shards.view(spec.name, box).copy_(whole[to_slices(box)])
