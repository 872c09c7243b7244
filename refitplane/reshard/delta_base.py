"""A sender's base for delta refits: a copy of the bytes it last sent.

A trainer rank can send a delta only against bytes the destination provably holds: the
version of its last complete send, kept here box for box (the same boxes it registers in
its `LocalShards`), on the device (fast: detection reads it at memory bandwidth) or in
page-locked host memory (saves device memory; detection then copies it back per message).
Memory cost: one copy of the rank's shards, `nbytes`.

The snapshot is taken after a send completed (while the trainer still holds its weights'
read-lock, so the bytes are exactly those sent) and dropped by any failure: a partly
updated base must never be used. A delta transfer whose messages send every element of the
snapshot exactly once advances it in place while it scans for changes (the changed words
written in the same pass, `DeltaExchange.encode`), so no copy is taken after it
(`advanced_to`); other transfers (a full refit, several target replicas, a host-side
snapshot) copy it whole after the send. Which version it holds is reported to the coordinator,
which allows a delta to a replica only when the replica holds that same version intact.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport


class SnapshotPlacement(StrEnum):
    DEVICE = "device"
    HOST = "host"


def _boxes(shards: LocalShards) -> tuple[tuple[object, ...], ...]:
    return tuple((sv.spec, sv.box) for sv in shards)


class DeltaSnapshot:
    def __init__(self, placement: SnapshotPlacement | str = SnapshotPlacement.DEVICE) -> None:
        try:
            self.placement = SnapshotPlacement(placement)
        except ValueError:
            raise InvalidArgument(
                f"delta snapshot placement must be 'device' or 'host', got {placement!r}",
                field="delta_snapshot",
            ) from None
        self.version = 0
        self._shards: LocalShards | None = None
        self._boxes: tuple[tuple[object, ...], ...] = ()

    @property
    def nbytes(self) -> int:
        if self._shards is None:
            return 0
        return sum(sv.tensor.numel() * sv.tensor.element_size() for sv in self._shards)

    def base_for(self, shards: LocalShards) -> LocalShards | None:
        """The snapshot as a registry with `shards`' boxes, or None when there is none or
        it was taken of other boxes (the trainer's layout changed)."""
        if self._shards is None or self.version == 0 or self._boxes != _boxes(shards):
            return None
        return self._shards

    def capture(self, shards: LocalShards, version: int) -> None:
        """Copy every view of `shards` as the base of `version` (memory reused while the
        boxes stay the same)."""
        if version <= 0:
            raise InvalidArgument(f"a delta base needs a version > 0, got {version}")
        self.version = 0  # a failure part-way leaves no usable base
        if self._shards is None or self._boxes != _boxes(shards):
            self._shards = self._allocate(shards)
            self._boxes = _boxes(shards)
        for mine, theirs in zip(self._shards, shards, strict=True):
            mine.tensor.copy_(theirs.tensor, non_blocking=True)
        first = next(iter(shards), None)
        if first is not None and first.tensor.device.type == "cuda":
            torch.cuda.current_stream(first.tensor.device).synchronize()
        self.version = version

    def after_send(self, shards: LocalShards, version: int, report: TransferReport) -> None:
        """After a completed send of `version` (`report`, its transfer's): no base where no
        delta will pay on the rank's links (`delta_base_needed`: memory given back), the
        version the scan advanced it to, else a copy of `shards`."""
        if not report.delta_base_needed:
            self.release()
        elif report.delta_base_advanced:
            self.advanced_to(version)
        else:
            self.capture(shards, version)

    def advanced_to(self, version: int) -> None:
        """The transfer's scan already wrote `version`'s bytes into the snapshot."""
        if version <= 0 or self._shards is None:
            raise InvalidArgument(f"no snapshot to advance to version {version}")
        self.version = version

    def invalidate(self) -> None:
        self.version = 0

    def release(self) -> None:
        self.version = 0
        self._shards = None
        self._boxes = ()

    def _allocate(self, shards: LocalShards) -> LocalShards:
        copy = LocalShards()
        for sv in shards:
            source = sv.tensor
            if self.placement is SnapshotPlacement.HOST and source.device.type == "cuda":
                tensor = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            else:
                tensor = torch.empty(source.shape, dtype=source.dtype, device=source.device)
            copy.add(sv.spec, sv.box, tensor)
        return copy
