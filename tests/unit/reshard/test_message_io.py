"""A message's local memory as the executor uses it: direct byte views, and a staging
buffer split into exactly the schedule's chunk ranges, contiguous chunks in bulk and
strided ones typed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from refitplane.reshard.boxes import box_shape, to_slices
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.message_io import message_io
from refitplane.reshard.plan import Link, Piece
from refitplane.reshard.schedule import link_messages
from tests.unit.reshard.test_schedule import links

pytestmark = pytest.mark.unit


def _local(spec: TensorSpec, strided: bool) -> torch.Tensor:
    """The tensor's storage, column-major when `strided` (so row boxes are not contiguous)."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(spec.dtype, torch.uint8)
    rows, cols = spec.shape
    if strided:
        return torch.zeros((cols, rows), dtype=dtype).t()
    return torch.zeros((rows, cols), dtype=dtype)


@settings(max_examples=150, deadline=None)
@given(links())
def test_staged_parts_are_the_schedule_chunk_ranges(
    case: tuple[Link, dict[str, TensorSpec]],
) -> None:
    link, specs = case
    cfg = TransferConfig(bucket_bytes=2048, max_inflight_bytes=8192)
    tensors = {
        name: _local(spec, strided=i % 2 == 1) for i, (name, spec) in enumerate(specs.items())
    }
    for m in link_messages(link, specs, cfg):
        views = [tensors[c.tensor][to_slices(c.box)] for c in m.chunks]
        io = message_io(m, views, specs)
        assert io.payload == sum(c.nbytes for c in m.chunks)
        if io.direct is not None:
            assert len(m.chunks) == 1
            assert views[0].is_contiguous()
            assert io.direct.numel() == m.nbytes
            assert io.direct.dtype == torch.uint8
            continue
        buf = torch.arange(m.nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        parts = io.parts(buf)
        assert len(parts) == len(m.chunks)
        for part, chunk in zip(parts, m.chunks, strict=True):
            assert torch.equal(part, buf[chunk.offset : chunk.offset + chunk.nbytes])
        assert sorted([*io.flat, *(s.index for s in io.strided)]) == list(range(len(m.chunks)))
        for i, flat in zip(io.flat, io.flat_views, strict=True):
            assert views[i].is_contiguous()
            assert flat.numel() == m.chunks[i].nbytes
            assert flat.data_ptr() == views[i].data_ptr()
        for s in io.strided:
            assert not views[s.index].is_contiguous()
            assert s.typed(parts[s.index]).shape == box_shape(m.chunks[s.index].box)


def test_single_elements_of_a_transposed_matrix_go_as_bytes() -> None:
    """A one-element box of column-major storage is contiguous with a stride that is not 1
    (found by the property test above): direct and bulk chunks still map to its bytes."""
    spec = TensorSpec.create("t", [5, 3], "bfloat16")
    local = _local(spec, strided=True)
    local[1, 0] = 2.5
    link = Link(0, 1, (Piece("t", ((1, 2), (0, 1))),), 2)
    for bucket in (4, 1024):  # alone (direct), then packed
        cfg = TransferConfig(bucket_bytes=bucket, max_inflight_bytes=4096)
        (m,) = link_messages(link, {"t": spec}, cfg)
        io = message_io(m, [local[1:2, 0:1]], {"t": spec})
        flat = io.direct if io.direct is not None else io.flat_views[0]
        assert flat.view(torch.bfloat16).tolist() == [2.5]
