"""The CUDA streams of a GPU transport's channels, and the ordering contexts the executor
asks for (`Transport.channel_context`, `beside`, `begin`, `end`): per channel a transfer
stream (NCCL's kernels, or CUDA IPC's copies), a pack stream (packing the next group
overlaps the current transfer) and a side stream (unpacking and checksums, so a channel's
next transfer does not wait for them).

Transfer and pack streams run at high priority: when checksums or unpacking (side streams,
default priority) fill the GPU, the SMs that free up go to the transfers first. (Lower is
higher; torch maps values beyond the device's range to its end.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.transport.base import P2POp, Transport

_HIGH = -8


def _stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]


class ChannelStreams:
    def __init__(self, device: torch.device, num_channels: int) -> None:
        self.device = device
        self.transfer = [_stream(device, _HIGH) for _ in range(num_channels)]
        self.side = [_stream(device, 0) for _ in range(num_channels)]
        self.pack = [_stream(device, _HIGH) for _ in range(num_channels)]

    def channel_context(self, channel: int) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.pack[channel])

    @contextlib.contextmanager
    def beside(self, channel: int, *, after_transfer: bool = True) -> Iterator[None]:
        side = self.side[channel]
        if after_transfer:
            side.wait_stream(self.transfer[channel])
        side.wait_stream(self.pack[channel])
        with torch.cuda.stream(side):
            yield

    def _all(self) -> tuple[torch.cuda.Stream, ...]:
        return (*self.transfer, *self.side, *self.pack)

    def begin(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for s in self._all():
            s.wait_stream(current)

    def end(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for s in self._all():
            current.wait_stream(s)

    def side_event(self, channel: int) -> torch.cuda.Event:
        """An event after the work queued on `channel`'s side stream so far (a fence)."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.side[channel])
        return event


class StreamedTransport(Transport):
    """A GPU transport whose channels are `ChannelStreams` (set `_channels` in __init__)."""

    device_ordered = True
    _channels: ChannelStreams

    def channel_context(self, channel: int) -> contextlib.AbstractContextManager[Any]:
        return self._channels.channel_context(channel)

    def beside(
        self, channel: int, *, after_transfer: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        return self._channels.beside(channel, after_transfer=after_transfer)

    def begin(self) -> None:
        self._channels.begin()

    def _check_buffers(self, ops: Sequence[P2POp], what: str) -> None:
        """Refuse, before anything is posted, a buffer the GPU transports cannot move."""
        for op in ops:
            buf = op.buffer
            if buf.dtype != torch.uint8 or buf.device != self.device or not buf.is_contiguous():
                raise InvalidArgument(
                    f"rank {self.rank}: {what} buffers must be contiguous uint8 on "
                    f"{self.device}, got {buf.dtype} on {buf.device}",
                    field="buffer",
                )

    def end(self) -> None:
        self._channels.end()
