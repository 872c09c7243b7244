"""A slice of a canonical tensor that this rank holds, and the registry it goes into."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import Box, box_shape, format_box
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards, dtype_name


@dataclass(frozen=True, slots=True)
class HeldSlice:
    """`view` (local memory, never a copy) holds `box` of the canonical tensor `name`."""

    name: str
    shape: tuple[int, ...]
    box: Box
    view: torch.Tensor


def register(slices: Iterable[HeldSlice], *, rank: int | None = None) -> LocalShards:
    """Collect held slices into a `LocalShards`; errors name the tensor, box and rank."""
    shards = LocalShards()
    for s in slices:
        if tuple(s.view.shape) != box_shape(s.box):
            raise LayoutError(
                f"view shape {list(s.view.shape)} does not match the box",
                tensor=s.name,
                rank=rank,
                box=format_box(s.box),
                field="shape",
            )
        try:
            shards.add(TensorSpec.create(s.name, s.shape, dtype_name(s.view.dtype)), s.box, s.view)
        except LayoutError as exc:
            if rank is None:
                raise
            # The registry does not know which rank it belongs to; say it here.
            located = LayoutError(exc.message, rank=rank, field=exc.field)
            located.tensor, located.box = exc.tensor, exc.box
            raise located from exc
    return shards
