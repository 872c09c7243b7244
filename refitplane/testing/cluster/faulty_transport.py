"""Fault injection for reliability tests: the real Gloo transport, plus faults a test arms.

`install(faults)` makes every group a data-plane rank of this process joins use
`FaultyGlooTransport`, a subclass of the production `GlooTransport` that behaves exactly
like it until an armed fault fires:

* **stall** (`stall_after_bytes=N`): once the rank has posted N bytes of sends/receives,
  it posts nothing more and never completes — a rank that stopped reading (receiver) or
  writing (sender). A hung rank (`stall_until="deadline"`) ignores aborts and is freed only
  by its own transfer deadline; `stall_until="abort"` waits for the coordinator's abort.
  A test may SIGKILL the process while it is stalled: a death at a known point mid-transfer.
* **slow** (`delay_s=D`): the next group is posted D seconds late — a rank slower than its
  peers (a transfer must survive it).
* **corrupt** (`corrupt_sends=1`): the next send carries a copy of its bytes with one bit
  flipped, *after* the executor took the message's checksum — corruption on the wire, the
  sender's parameters untouched. The receivers' verification must catch it.
* **misreport** (`misreport_done=1`): the rank's next TransferDone claims nothing moved and
  nothing was verified (tensors 0 of 0, bytes 0) whatever really happened — a lying or
  buggy agent; the coordinator must check it against the plan (`agent_procs` applies it).

Faults are one-shot: each fires once and disarms. The counters (transports created,
aborted, closed; stalls; corruptions) are what the status endpoint of `agent_procs` reports,
e.g. to prove that a failed refit aborted every communicator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from refitplane.errors import InvalidArgument, TransferError, TransferTimeout
from refitplane.reshard.transport import gloo
from refitplane.reshard.transport.base import Handle, P2POp

StallUntil = Literal["deadline", "abort"]
_STALL_POLL_S = 0.02


@dataclass
class FaultCounters:
    transports_created: int = 0
    transports_aborted: int = 0
    transports_closed: int = 0
    stalls: int = 0
    corrupted_sends: int = 0
    delays: int = 0
    misreports: int = 0
    # Bytes posted since the current stall was armed.
    bytes_posted: int = 0
    stalled: bool = False

    @property
    def transports_open(self) -> int:
        return self.transports_created - self.transports_aborted - self.transports_closed


@dataclass
class Faults:
    """Armed faults and counters of one process; every method is thread-safe."""

    stall_after_bytes: int | None = None
    stall_until: StallUntil = "deadline"
    corrupt_sends: int = 0
    delay_s: float = 0.0
    hold: bool = False
    misreport_done: int = 0
    counters: FaultCounters = field(default_factory=FaultCounters)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, repr=False)

    def arm(
        self,
        *,
        stall_after_bytes: int | None = None,
        stall_until: str = "deadline",
        corrupt_sends: int = 0,
        delay_s: float = 0.0,
        hold: bool = False,
        misreport_done: int = 0,
    ) -> None:
        if stall_until not in ("deadline", "abort"):
            raise InvalidArgument(
                f"stall_until must be 'deadline' or 'abort', not {stall_until!r}",
                field="stall_until",
            )
        if stall_after_bytes is not None and stall_after_bytes < 0:
            raise InvalidArgument("stall_after_bytes must be >= 0", field="stall_after_bytes")
        with self._lock:
            self.stall_after_bytes = stall_after_bytes
            self.stall_until = "abort" if stall_until == "abort" else "deadline"
            self.corrupt_sends = max(0, corrupt_sends)
            self.delay_s = max(0.0, delay_s)
            self.hold = hold
            if hold:
                self._released.clear()
            self.misreport_done = max(0, misreport_done)
            self.counters.bytes_posted = 0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                **asdict(c),
                "transports_open": c.transports_open,
                "armed_stall_after_bytes": self.stall_after_bytes,
                "armed_corrupt_sends": self.corrupt_sends,
                "armed_delay_s": self.delay_s,
                "armed_hold": self.hold,
                "armed_misreport_done": self.misreport_done,
            }

    # -- called by the transport ------------------------------------------------------------

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + 1)

    def transport_ended(self) -> None:
        """A stall that fired ends with its transport, even if nobody waited on it (the
        executor may fail elsewhere first); one armed but not fired stays armed."""
        with self._lock:
            if self.counters.stalled:
                self.counters.stalled = False
                self.stall_after_bytes = None

    def take_misreport(self) -> bool:
        """Whether this TransferDone must be replaced by an empty one (once per arming)."""
        with self._lock:
            if self.misreport_done <= 0:
                return False
            self.misreport_done -= 1
            self.counters.misreports += 1
            return True

    def take_delay(self) -> float:
        """The delay to apply before posting this group (once)."""
        with self._lock:
            delay, self.delay_s = self.delay_s, 0.0
            if delay:
                self.counters.delays += 1
            return delay

    def release(self) -> None:
        """Let a held transfer go on (a no-op when nothing is held)."""
        self._released.set()

    def wait_if_held(self, rank: int, deadline: float) -> None:
        """Hold this group (once per arming) until `release` or the transfer deadline: a
        transfer a test keeps running for exactly as long as it needs, whatever the load."""
        with self._lock:
            held, self.hold = self.hold, False
            if held:
                self.counters.delays += 1
        if held and not self._released.wait(max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"rank {rank}: held transfer reached its deadline unreleased")

    def should_stall(self, ops: Sequence[P2POp]) -> bool:
        """Whether this group must not be posted; otherwise count its bytes."""
        with self._lock:
            limit = self.stall_after_bytes
            if limit is not None and self.counters.bytes_posted >= limit:
                if not self.counters.stalled:
                    self.counters.stalled = True
                    self.counters.stalls += 1
                return True
            self.counters.bytes_posted += sum(op.buffer.numel() for op in ops)
            return False

    def corrupt(self, ops: Sequence[P2POp]) -> list[P2POp]:
        """The ops to post: the first send, while armed, as a copy with one bit flipped."""
        out = list(ops)
        with self._lock:
            if self.corrupt_sends <= 0:
                return out
            for i, op in enumerate(out):
                if op.send and op.buffer.numel() > 0:
                    bad = op.buffer.clone()
                    bad[bad.numel() // 2] ^= 0x10
                    out[i] = P2POp(True, op.peer, bad)
                    self.corrupt_sends -= 1
                    self.counters.corrupted_sends += 1
                    break
        return out

    def hang(self, rank: int, deadline: float, cancel: threading.Event | None) -> None:
        """Block like a rank that stopped moving bytes; always ends by raising."""
        try:
            while True:
                if self.stall_until == "abort" and cancel is not None and cancel.is_set():
                    raise TransferError(f"rank {rank}: transfer cancelled (while stalled)")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(
                        f"rank {rank}: stalled rank reached its transfer deadline"
                    )
                time.sleep(min(remaining, _STALL_POLL_S))
        finally:
            with self._lock:
                self.counters.stalled = False
                self.stall_after_bytes = None


class _Stalled:
    """Payload of a handle whose ops were never posted."""


def faulty_transport_class(faults: Faults) -> type[gloo.GlooTransport]:
    """A `GlooTransport` subclass bound to `faults`."""

    class FaultyGlooTransport(gloo.GlooTransport):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Corrupted copies must outlive their sends.
            self._keep: list[torch.Tensor] = []
            self._ended = False
            faults.count("transports_created")

        def _end(self, how: str) -> None:
            # A transport is aborted by the failing executor and again by LeaveGroup:
            # count it once.
            if not self._ended:
                self._ended = True
                faults.count(how)
            faults.transport_ended()
            self._keep.clear()

        def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
            delay = faults.take_delay()
            if delay:
                time.sleep(delay)
            faults.wait_if_held(self.rank, deadline)
            if faults.should_stall(ops):
                return Handle(channel, _Stalled())
            posted = faults.corrupt(ops)
            self._keep.extend(p.buffer for p, o in zip(posted, ops, strict=True) if p is not o)
            return super().issue(channel, posted, deadline)

        def poll(self, handle: Handle) -> bool:
            if isinstance(handle.payload, _Stalled):
                return False
            return super().poll(handle)

        def wait(
            self, handle: Handle, deadline: float, cancel: threading.Event | None = None
        ) -> None:
            if isinstance(handle.payload, _Stalled):
                faults.hang(self.rank, deadline, cancel)
            super().wait(handle, deadline, cancel)

        def abort(self) -> None:
            self._end("transports_aborted")
            super().abort()

        def close(self) -> None:
            self._end("transports_closed")
            super().close()

    return FaultyGlooTransport


def install(faults: Faults) -> None:
    """Make data-plane members of this process build `FaultyGlooTransport`s.

    `DataPlaneMember.on_join_group` looks `GlooTransport` up in its module when a group is
    joined, so rebinding the module attribute is enough (test processes only)."""
    gloo.GlooTransport = faulty_transport_class(faults)  # type: ignore[misc]
