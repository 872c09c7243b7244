"""The checksum tables' swap after the last message (`RunChecksums.exchange`).

Where the transport orders work on the device (NCCL, CUDA IPC), the swap is posted right
after the last group, before the host waits for any group: it travels behind the data, with
no round trip after the host saw the last group complete. Where it does not (Gloo), it is
posted after every group completed, as the sums are taken on the host. Either way a byte
changed on the wire fails the refit naming the tensor. Two ranks over the in-process
loopback transport, bytes moved and checksummed for real.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from refitplane.errors import ChecksumMismatch
from refitplane.reshard.boxes import full_box
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.schedule import rank_schedule
from refitplane.reshard.transport.base import Handle, P2POp
from tests.unit.reshard.loopback import (
    Corrupt,
    LoopbackHub,
    LoopbackTransport,
    bf16_pair_shards,
    pair_plans,
    run_pair,
)

pytestmark = pytest.mark.unit

CONFIG = TransferConfig(bucket_bytes=4096, max_inflight_bytes=65536, num_channels=2, timeout_s=30)


def _specs() -> dict[str, TensorSpec]:
    specs = [
        TensorSpec.create(f"model.layers.{layer}.mlp.{name}.weight", [32, 64], "bfloat16")
        for layer in range(6)
        for name in ("up_proj", "down_proj")
    ]
    return {s.name: s for s in specs}


class CallRecorder(LoopbackTransport):
    """The loopback transport on the device-ordered path or not, recording the order of
    posts ("data" for the schedule's messages, "swap" for the tables after them) and of
    waits. Device-ordered: a group is complete when `issue` returns, as work queued after
    it on a GPU runs after its transfer."""

    def __init__(self, hub: LoopbackHub, rank: int, messages: int, ordered: bool) -> None:
        super().__init__(hub, rank, 2, CONFIG.num_channels)
        self.device_ordered = ordered
        self.left = messages
        self.calls: list[str] = []

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        self.calls.append("data" if self.left > 0 else "swap")
        self.left -= len(ops)
        handle = super().issue(channel, ops, deadline)
        if self.device_ordered:
            LoopbackTransport.wait(self, handle, deadline)
        return handle

    def poll(self, handle: Handle) -> bool:
        # Device-ordered: every group stays in flight until the run waits for it, as the
        # last groups on a GPU still are when the last one is posted.
        return False if self.device_ordered else super().poll(handle)

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        self.calls.append("wait")
        super().wait(handle, deadline, cancel)


def _run(
    ordered: bool, corrupt: Corrupt | None = None
) -> tuple[list[CallRecorder], dict[int, BaseException]]:
    specs = _specs()
    plans = pair_plans(specs)
    hub = LoopbackHub(corrupt)
    counts = [sum(1 for _ in rank_schedule(plans[r], CONFIG).messages) for r in (0, 1)]
    recorders = [CallRecorder(hub, r, counts[r], ordered) for r in (0, 1)]
    values, source, target = bf16_pair_shards(specs)
    errors = run_pair(hub, recorders, plans, (source, target), CONFIG)
    if not errors:
        for name, spec in specs.items():
            assert torch.equal(target.view(name, full_box(spec.shape)), values[name]), name
    return recorders, errors


@pytest.mark.parametrize("ordered", [True, False], ids=["device-ordered", "host-ordered"])
def test_the_tables_swap_once_after_the_last_message(ordered: bool) -> None:
    recorders, errors = _run(ordered)
    assert not errors, errors
    for rec in recorders:
        assert rec.calls.count("swap") == 1, rec.calls
        swap = rec.calls.index("swap")
        assert "data" not in rec.calls[swap:], rec.calls
        waits_after = rec.calls[swap + 1 :].count("wait")
        if ordered:
            # Posted before the waits for the last groups, then waited for itself.
            assert waits_after >= 2, rec.calls
        else:
            # Posted once every group completed: only its own wait follows.
            assert waits_after == 1, rec.calls


@pytest.mark.parametrize("ordered", [True, False], ids=["device-ordered", "host-ordered"])
def test_a_byte_changed_on_the_wire_fails_the_receiver_naming_the_tensor(ordered: bool) -> None:
    def flip(src: int, dst: int, channel: int, n: int, data: torch.Tensor) -> None:
        if (src, dst, channel, n) == (0, 1, 1, 2):
            data[7] ^= 0x10

    _, errors = _run(ordered, flip)
    assert isinstance(errors.get(1), ChecksumMismatch), errors
    assert "model.layers." in str(errors[1])
    assert "bytes from rank 0" in str(errors[1])
