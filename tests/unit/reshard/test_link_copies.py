"""CUDA IPC link copies, the logic that needs no GPU: both ends list a link's chunks in the
same order, the sender's description of where each lies (manifest rows) rebuilds views that
copy exactly the right bytes into the receiver's memory — contiguous, resharded (strided on
either end), fused runs — with equal per-chunk checksums on both ends; the copy kernel that
checksums as it copies, in Triton's interpreter and compiled for Hopper."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from refitplane.reshard.boxes import box_shape, to_slices
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.link_copies import (
    ChunkSums,
    ReceiverCopies,
    _merge,
    chunk_source,
    link_chunks,
)
from refitplane.reshard.message_io import resolve_messages
from refitplane.reshard.planner import build_plan
from refitplane.reshard.schedule import rank_schedule
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transport.ipc_manifest import IpcManifest
from tests.unit.reshard.interpreter import run_in_interpreter
from tests.unit.reshard.ipc_fixtures import storage_record
from tests.unit.reshard.triton_hopper import compiles_for_hopper

pytestmark = pytest.mark.unit

R, C = 48, 40
NAMES = ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight")


def _layouts(case: str) -> tuple[Layout, Layout]:
    """Rank 0 holds, rank 1 needs: "whole" (both whole), "tp2" (column halves → row halves:
    strided on the receiver), "tp2-back" (row halves → column halves: strided on the
    sender), "rows" (the receiver's row quarters of one tensor are one span each)."""
    src, dst = LayoutBuilder(), LayoutBuilder()
    for name in NAMES:
        spec = TensorSpec.create(name, [R, C], "bfloat16")
        if case == "whole":
            src.add(spec, 0, ((0, R), (0, C)))
            dst.add(spec, 1, ((0, R), (0, C)))
        elif case in ("tp2", "tp2-back"):
            cols = [((0, R), (h * C // 2, (h + 1) * C // 2)) for h in range(2)]
            rows = [((h * R // 2, (h + 1) * R // 2), (0, C)) for h in range(2)]
            held, needed = (cols, rows) if case == "tp2" else (rows, cols)
            for box in held:
                src.add(spec, 0, box)
            for box in needed:
                dst.add(spec, 1, box)
        else:
            src.add(spec, 0, ((0, R), (0, C)))
            for q in range(4):
                dst.add(spec, 1, ((q * R // 4, (q + 1) * R // 4), (0, C)))
    return src.build(), dst.build()


def _truth(spec: TensorSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(spec.name))
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(torch.bfloat16).view(spec.shape)


def _shards(layout: Layout, rank: int, *, fill: bool) -> LocalShards:
    shards = LocalShards()
    for t in layout:
        for box in t.boxes.get(rank, ()):
            local = torch.zeros(box_shape(box), dtype=torch.bfloat16)
            if fill:
                local.copy_(_truth(t.spec)[to_slices(box)])
            shards.add(t.spec, box, local)
    return shards


@pytest.mark.parametrize("case", ["whole", "tp2", "tp2-back", "rows"])
def test_a_link_copies_exactly_what_the_senders_manifest_describes(case: str) -> None:
    source, target = _layouts(case)
    plan = build_plan(source, target)
    config = TransferConfig(bucket_bytes=2048, max_inflight_bytes=4096)
    ends = {}
    for rank, layout in ((0, source), (1, target)):
        shards = _shards(layout, rank, fill=rank == 0)
        rank_plan = plan.rank_plan(rank)
        steps = resolve_messages(rank_plan, rank_schedule(rank_plan, config), shards)
        ends[rank] = (shards, link_chunks(steps, rank))
    sent = ends[0][1][0][1]  # rank 0's chunks to rank 1
    received = ends[1][1][1][0]  # rank 1's chunks from rank 0
    assert [lc.chunk for lc in sent] == [lc.chunk for lc in received]
    # The sender: one storage entry per tensor its chunks lie in, a row per chunk.
    storages: dict[int, torch.Tensor] = {}
    rows = []
    for lc in sent:
        storage = lc.view.untyped_storage()
        if storage.data_ptr() not in storages:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
            storages[storage.data_ptr()] = whole
        rows.append(chunk_source(lc.view, list(storages).index(storage.data_ptr())))
    records = tuple(storage_record(i, t.numel()) for i, t in enumerate(storages.values()))
    manifest = IpcManifest.decode(IpcManifest(1, records, tuple(rows)).encode(), where="link")
    assert manifest.chunks == tuple(rows)
    if case == "tp2-back":
        assert any(not row.contiguous for row in manifest.chunks)  # strided on the sender
    # The receiver ("opened" storages: the sender's own, in this process).
    copies = ReceiverCopies.build(
        received,
        manifest,
        list(storages.values()),
        plan.specs,
        "link",
        verify=True,
        fuse=False,
        device=torch.device("cpu"),
        budget=4096,
    )
    copies.launch()
    copies.launch()  # every refit again: the same copies, the sums from zero
    receiver = ends[1][0]
    for t in target:
        for box in t.boxes[1]:
            assert torch.equal(
                receiver.view(t.spec.name, box).contiguous().view(torch.uint8),
                _truth(t.spec)[to_slices(box)].contiguous().view(torch.uint8),
            ), (t.spec.name, box)
    sender_sums = torch.zeros((len(sent), 2), dtype=torch.int64)
    ChunkSums(sent, sender_sums.unbind(0), budget=4096).launch()
    assert copies.sums is not None
    assert torch.equal(copies.sums, sender_sums)
    assert bool((sender_sums != 0).any())


def test_chunks_that_continue_each_other_on_both_ends_copy_as_one() -> None:
    a, b = torch.zeros(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    merged = _merge([(a[0:10], b[5:15]), (a[10:20], b[15:25]), (a[30:40], b[25:35])])
    assert [(d.data_ptr() - a.data_ptr(), d.numel()) for d, _ in merged] == [(0, 20), (30, 10)]
    assert [(s.data_ptr() - b.data_ptr(), s.numel()) for _, s in merged] == [(5, 20), (25, 10)]


_needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton")


@_needs_triton
def test_the_copy_kernel_copies_and_checksums_exactly_in_the_interpreter() -> None:
    run_in_interpreter("refitplane.reshard.copy_sums", "check")


@_needs_triton
@pytest.mark.parametrize("aligned", [True, False])
def test_the_copy_kernel_compiles_for_hopper(aligned: bool) -> None:
    """Both variants compile; told that its chunks are 16-byte aligned, the kernel moves 16
    bytes per access (`v2.b64`: half the memory instructions of 8-byte ones), else 8."""
    from refitplane.reshard import copy_sums as cs

    constexprs = {"BLOCK": cs._BLOCK, "ITERS": cs._ITERS, "STEPS": cs._SEARCH_STEPS}
    ptx = compiles_for_hopper(
        cs.triton_kernel(),
        {"tab": "*i64", "n": "i32"},
        {**constexprs, "ROW": cs._ROW, "ALIGNED": aligned},
    )
    if ptx is None:
        pytest.skip("no ptxas here: the front end ran, the accesses cannot be read")
    wide = ("ld.global.v2.b64" in ptx, "st.global.v2.b64" in ptx)
    assert wide == (aligned, aligned), wide
