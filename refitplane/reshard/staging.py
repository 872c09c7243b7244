"""Bounded staging memory: one preallocated byte arena used as a FIFO ring.

Packed sends and receives borrow slices of the arena and give them back by token, in any
order; space is reclaimed from the oldest slice on, once it is back (slices of different
channels interleave, so a later slice may come back first). The arena never grows, so a
rank's extra memory during a refit is at most `max_inflight_bytes`.
"""

from __future__ import annotations

from collections import deque

import torch

from refitplane.errors import InvalidArgument

_ALIGN = 256


class StagingRing:
    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._head = 0
        # [start, end, returned] per slice still holding space, oldest first.
        self._live: deque[list[int]] = deque()
        self._by_token: dict[int, list[int]] = {}
        self._next_token = 0
        self.peak = 0
        self._in_use = 0

    @property
    def buffer(self) -> torch.Tensor:
        return self.reserve()

    def reserve(self) -> torch.Tensor:
        """The arena, allocated now if it is not yet (call it before transfers are in
        flight: device allocations then can deadlock, see executor.py)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        return self._buffer

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def try_take(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """(token, slice of `nbytes`), or None while older slices still occupy the space."""
        if nbytes > self.size:
            raise InvalidArgument(
                f"a message of {nbytes} bytes exceeds the staging budget of {self.size} bytes",
                field="max_inflight_bytes",
            )
        need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        start = self._fit(min(need, self.size))
        if start is None:
            return None
        end = min(start + need, self.size)
        entry = [start, end, 0]
        token = self._next_token
        self._next_token += 1
        self._live.append(entry)
        self._by_token[token] = entry
        self._head = end
        self._in_use += end - start
        self.peak = max(self.peak, self._in_use)
        return token, self.buffer[start : start + nbytes]

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

    def release(self, token: int) -> None:
        entry = self._by_token.pop(token)
        entry[2] = 1
        while self._live and self._live[0][2]:
            start, end, _ = self._live.popleft()
            self._in_use -= end - start
        if not self._live:
            self._head = 0

    @property
    def live(self) -> int:
        return len(self._live)

    def free(self) -> None:
        """Drop the arena (between refits, to give the memory back)."""
        if self._live:
            raise RuntimeError("staging still in use")
        self._buffer = None
