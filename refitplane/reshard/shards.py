"""Local shards: where, in this rank's memory, each box it holds or needs lives.

An agent (trainer or generator) registers, for each canonical tensor, the global boxes it
holds/needs and a *view* of local memory with exactly that box's shape and the tensor's
dtype (e.g. the `q_proj` rows of a fused vLLM `qkv_proj` parameter). The executor reads
sends from and writes receives into these views, in place; the published layout is derived
from the same registrations, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import (
    Box,
    box_shape,
    contains,
    format_box,
    intersect,
    relative,
    to_slices,
)
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class ShardView:
    spec: TensorSpec
    box: Box
    tensor: torch.Tensor


class LocalShards:
    """The registry of one rank's shard views, by canonical tensor name."""

    def __init__(self) -> None:
        self._views: dict[str, list[ShardView]] = {}
        self._specs: dict[str, TensorSpec] = {}
        # Bumped by every `add`: whoever caches views of these shards checks it.
        self.version = 0

    def add(self, spec: TensorSpec, box: Box, tensor: torch.Tensor) -> None:
        """Register `tensor` (a view of local memory) as holding `box` of `spec`."""
        expected = box_shape(box)
        if tuple(tensor.shape) != expected:
            raise LayoutError(
                f"local view has shape {list(tensor.shape)}, the box needs {list(expected)}",
                tensor=spec.name,
                box=format_box(box),
                field="shape",
            )
        if dtype_name(tensor.dtype) != spec.dtype:
            raise LayoutError(
                f"local view has dtype {dtype_name(tensor.dtype)}, the tensor is {spec.dtype}",
                tensor=spec.name,
                box=format_box(box),
                field="dtype",
            )
        known = self._specs.setdefault(spec.name, spec)
        if known != spec:
            raise LayoutError(
                f"registered as {list(spec.shape)} {spec.dtype} and as {list(known.shape)} {known.dtype}",
                tensor=spec.name,
            )
        views = self._views.setdefault(spec.name, [])
        for other in views:
            if intersect(other.box, box) is not None:
                raise LayoutError(
                    f"overlaps the already registered box {format_box(other.box)}",
                    tensor=spec.name,
                    box=format_box(box),
                )
        views.append(ShardView(spec, box, tensor))
        self.version += 1

    def __iter__(self) -> Iterator[ShardView]:
        for name in sorted(self._views):
            yield from self._views[name]

    def __len__(self) -> int:
        return sum(len(v) for v in self._views.values())

    def fingerprint(self) -> tuple[tuple[object, ...], ...]:
        """What views resolved from these shards depend on: every registered box with the
        memory behind it. Two registries over the same parameters (a trainer that rebuilds
        its `LocalShards` each refit) have equal fingerprints."""
        return tuple(
            (sv.spec, sv.box, sv.tensor.data_ptr(), sv.tensor.stride(), sv.tensor.device)
            for sv in self
        )

    def names(self) -> list[str]:
        return sorted(self._views)

    def spec(self, name: str) -> TensorSpec:
        return self._specs[name]

    def views_of(self, name: str) -> list[ShardView]:
        return list(self._views.get(name, ()))

    def view(self, name: str, box: Box) -> torch.Tensor:
        """The local memory holding `box` of tensor `name` (a view, never a copy)."""
        for sv in self._views.get(name, ()):
            if contains(sv.box, box):
                return sv.tensor[to_slices(relative(box, sv.box))]
        raise LayoutError(
            "this rank registered no local storage containing the box",
            tensor=name,
            box=format_box(box),
        )

    def layout(self, rank: int) -> Layout:
        builder = LayoutBuilder()
        for sv in self:
            builder.add(sv.spec, rank, sv.box)
        return builder.build()
