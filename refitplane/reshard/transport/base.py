"""One point-to-point transport interface; Gloo (CPU) and nccl4py (GPU) implement it.

Buffers are always 1-D contiguous `uint8` tensors, so any dtype (bf16, fp8, mixed buckets)
moves the same way. A transport has `num_channels` independent channels (on GPU: one
communicator and one CUDA stream each). `issue` posts one group of sends/receives on a
channel and returns a handle; `wait` blocks until the handle completes, the deadline
passes, or the cancel event is set — never longer.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class P2POp:
    send: bool
    peer: int
    buffer: torch.Tensor


class Handle:
    """Opaque completion handle returned by `Transport.issue`/`fence`."""

    __slots__ = ("channel", "payload")

    def __init__(self, channel: int, payload: Any) -> None:
        self.channel = channel
        self.payload = payload


class Transport(ABC):
    rank: int
    world_size: int
    num_channels: int
    device: torch.device
    # True when work queued on a channel after `issue` is ordered after the transfer by
    # the device itself (CUDA streams): unpacking can be queued without a host wait.
    device_ordered: bool = False
    # True when `order_after` can order a channel's later work after a handle on the device:
    # the executor then gives staging back when a group is posted, not when it completed.
    device_reuse: bool = False
    # True when a receiver can read its senders' memory itself (CUDA IPC): the executor then
    # runs each link as one copy of all its chunks (`ipc_run.py`) instead of messages.
    copies_links: bool = False
    # Host seconds `issue` spent waiting for the transport to take posted groups (a profile).
    settle_seconds: float = 0.0
    # Senders on CUDA: the fastest rate (bytes/s) a mostly dense transfer over this
    # transport moved its bytes at (`Executor`; what "auto" deltas must beat, `delta_cost`).
    # Kept here, not on the executor: an agent makes a new executor when its config changes.
    link_rate: float | None = None
    # (src, dst) links whose two ends agreed, in the checksum exchange of the last refit
    # that ran them, that no delta can win on them: their next "auto" delta refit runs the
    # full path (`link_agreement`). Both ends' copies live and die with the group (a failed
    # transfer aborts it), so they cannot disagree; replaced, never mutated.
    full_links: frozenset[tuple[int, int]] = frozenset()

    def channel_context(self, channel: int) -> contextlib.AbstractContextManager[Any]:
        """Context for work that must precede the channel's next posted transfer (packing)."""
        return contextlib.nullcontext()

    def beside(
        self, channel: int, *, after_transfer: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        """Context for work ordered after everything queued on `channel` so far (unpacking,
        checksums) that the channel's later transfers need not wait for (a side stream).
        `after_transfer=False`: ordered after the channel's packing only, beside its
        transfers (a sender's checksums of what it packed: they read what the transfer
        reads, and so run while it runs instead of after it)."""
        return contextlib.nullcontext()

    def connect(self, peers: Sequence[int], deadline: float) -> None:  # noqa: B027
        """Before a transfer's first op: make sure every channel is connected to every rank
        in `peers` (both directions), so that posting never waits for a peer (optional:
        transports that connect eagerly need nothing)."""

    def order_after(self, channel: int, handles: Sequence[Handle]) -> None:  # noqa: B027
        """The channel's work queued from now on (packing, then its transfers) runs after
        `handles` completed, with no host wait. Called only where `device_reuse` is set
        (other transports complete a handle on the host before its staging is reused)."""

    def begin(self) -> None:  # noqa: B027 - optional hook
        """Order the channels after work already queued by the caller (e.g. optimizer step)."""

    def end(self) -> None:  # noqa: B027 - optional hook
        """Order the caller's later work after everything queued on the channels."""

    @abstractmethod
    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        """Post `ops` as one group on `channel` (posting itself may wait for peers to
        connect: it gives up at `deadline`)."""

    def fence(self, handle: Handle) -> Handle:
        """A handle that completes after `handle` and after the work queued `beside` its
        channel since."""
        return handle

    @abstractmethod
    def poll(self, handle: Handle) -> bool:
        """Non-blocking: has `handle` completed? (Errors surface in `wait`.)"""

    @abstractmethod
    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        """Block until `handle` completes; raise TransferTimeout / PeerFailure / TransferError."""

    @abstractmethod
    def abort(self) -> None:
        """Cancel everything in flight; the transport is unusable afterwards."""

    @abstractmethod
    def close(self) -> None:
        """Release resources after a clean finish."""
