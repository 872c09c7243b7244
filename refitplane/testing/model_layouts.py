"""Trainer and generator layouts of a Qwen3-shaped model (see `refit_world.SHAPES`), as the
GPU benchmarks lay them out: trainer TP2 on GPUs 0-1 (the HF tensor-parallel split, experts
split like vLLM does without expert parallelism), generator replicas from GPU 2 on."""

from __future__ import annotations

from refitplane.generator.hf_tensor_parallel import tp_boxes
from refitplane.reshard.boxes import Box
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Shard, placement_boxes
from refitplane.testing import refit_world as rw

TRAINER_TP = 2


def vllm_tp_boxes(ts: TensorSpec, tp: int, ranks: range) -> dict[int, Box]:
    """vLLM's TP split of one checkpoint tensor: HF's, except that every expert's
    intermediate dimension is split too (vLLM without expert parallelism)."""
    if ".mlp.experts." not in ts.name:
        return tp_boxes(ts, tp, ranks)
    dim = 1 if ts.name.endswith("down_proj.weight") else 0
    mesh = DeviceMesh.create([tp], list(ranks), tensor=ts.name)
    return placement_boxes(ts.shape, mesh, [Shard(dim)], tensor=ts.name)


def model_layouts(shape: str, replica_tps: tuple[int, ...]) -> tuple[Layout, Layout]:
    """(trainer layout on ranks 0-1, generator layout on ranks 2..) for `shape`."""
    src, dst = LayoutBuilder(), LayoutBuilder()
    for ts in rw.tensor_specs(shape):
        for r, box in tp_boxes(ts, TRAINER_TP).items():
            src.add(ts, r, box)
        first = TRAINER_TP
        for tp in replica_tps:
            for r, box in vllm_tp_boxes(ts, tp, range(first, first + tp)).items():
                dst.add(ts, r, box)
            first += tp
    return src.build(), dst.build()
