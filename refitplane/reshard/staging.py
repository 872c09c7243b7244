"""Bounded staging memory: one preallocated byte arena used as a FIFO ring.

Packed sends and receives borrow slices of the arena and give them back by token, in any
order; space is reclaimed from the oldest slice on, once it is back (slices of different
channels interleave, so a later slice may come back first). The arena never grows; it is
sized for the plan it serves (`prepared_plan.staging_room`): at most what the plan's packed
messages take, and, with the staged arena of a receiver that stages its weights
(`staged.py`), within `max_inflight_bytes`.

A slice may be given back before the device is done with it (`release(token, after=h)`:
free once the transport handle `h` completes). Whoever takes that space next gets `h`
back from `try_take` and orders its work after it on the device (`Transport.order_after`),
so on GPUs the host never waits for staging space: a slice comes back when its group is
posted, and its next user's packing starts, on the device, the moment the transfer and
checksum that read it are done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from refitplane.errors import InvalidArgument

_ALIGN = 256


def ring_bytes_for(sizes: Iterable[int]) -> int:
    """Ring bytes that hold slices of all these sizes at once (each slice aligned): a ring
    this large never makes a message wait for space."""
    return sum(aligned(n) for n in sizes)


def aligned(n: int) -> int:
    """`n` bytes rounded up to the alignment every carved region of device staging starts
    at (ring slices here, staged tensors in `staged.py`'s arena)."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StagingRing:
    """`size`: sized for the plan it serves (`prepared_plan.staging_room`): never more than
    `max_inflight_bytes`, nor than the plan's packed messages take; 0 reserves nothing."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._head = 0
        # [start, end, returned, after] per slice still holding space, oldest first.
        self._live: deque[list[Any]] = deque()
        self._by_token: dict[int, list[Any]] = {}
        # Space reclaimed while the device may still use it: (start, end, after).
        self._pending: list[tuple[int, int, object]] = []
        self._next_token = 0
        self.peak = 0
        self._in_use = 0

    @property
    def buffer(self) -> torch.Tensor:
        return self._allocate()

    def _allocate(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        return self._buffer

    def reserve(self) -> None:
        """A transfer starts: allocate the arena now if it is not yet (before transfers are
        in flight: device allocations then can deadlock, see executor.py; a ring of 0 bytes
        allocates nothing) and start a new peak."""
        self.peak = self._in_use
        if self.size:
            self._allocate()

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def try_take(self, nbytes: int) -> tuple[int, torch.Tensor, tuple[object, ...]] | None:
        """(token, slice of `nbytes`, what its work must follow on the device: the `after`
        of released slices it overlaps), or None while older slices still occupy the space."""
        if nbytes > self.size:
            raise InvalidArgument(
                f"a message of {nbytes} bytes exceeds the staging ring of {self.size} bytes "
                "(sized for the plan's packed messages, within max_inflight_bytes)",
                field="max_inflight_bytes",
            )
        need = aligned(nbytes)
        start = self._fit(min(need, self.size))
        if start is None:
            return None
        end = min(start + need, self.size)
        entry: list[Any] = [start, end, 0, None]
        token = self._next_token
        self._next_token += 1
        self._live.append(entry)
        self._by_token[token] = entry
        self._head = end
        self._in_use += end - start
        self.peak = max(self.peak, self._in_use)
        return token, self.buffer[start : start + nbytes], self._follow(start, end)

    def _follow(self, start: int, end: int) -> tuple[object, ...]:
        """The `after` of reclaimed space overlapping [start, end). That space is forgotten
        (only the parts outside the new slice stay): the new slice's own `after` comes later
        on the device than these (its user waits for them), so a later taker of that space
        follows the new one. The pending pieces never overlap, so there are at most about
        twice as many as slices fit in the ring."""
        if not self._pending:
            return ()
        follow: list[object] = []
        kept: list[tuple[int, int, object]] = []
        for s, e, a in self._pending:
            if e <= start or end <= s:
                kept.append((s, e, a))
                continue
            if a not in follow:
                follow.append(a)
            if s < start:
                kept.append((s, start, a))
            if end < e:
                kept.append((end, e, a))
        self._pending = kept
        return tuple(follow)

    def _fit(self, need: int) -> int | None:
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        if self._head > tail:
            if self._head + need <= self.size:
                return self._head
            return 0 if need <= tail else None
        # head < tail: the free space is [head, tail); head == tail: the ring is full.
        if self._head < tail and self._head + need <= tail:
            return self._head
        return None

    def release(self, token: int, after: object | None = None) -> None:
        """Give a slice back. `after`: the device may still use it until `after` (a transport
        handle) completes; its space goes to the next taker with `after` to follow."""
        entry = self._by_token.pop(token)
        entry[2] = 1
        entry[3] = after
        while self._live and self._live[0][2]:
            start, end, _, done_after = self._live.popleft()
            self._in_use -= end - start
            if done_after is not None:
                self._pending.append((start, end, done_after))
        if not self._live:
            self._head = 0

    def settled(self) -> None:
        """Everything given back is done on the device too (a drained transfer)."""
        self._pending.clear()

    @property
    def live(self) -> int:
        return len(self._live)

    def free(self) -> None:
        """Drop the arena (between refits, to give the memory back)."""
        if self._live:
            raise RuntimeError("staging still in use")
        self._pending.clear()
        self._buffer = None
