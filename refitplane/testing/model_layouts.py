"""Trainer and generator layouts of a Qwen3-shaped model (see `model_shapes.SHAPES`), as the
GPU benchmarks lay them out: trainer TP ranks on the first GPUs (the HF tensor-parallel
split), generator replicas on the GPUs after them (vLLM's split: experts split like vLLM
does without expert parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

from refitplane.generator.hf_tensor_parallel import tp_boxes
from refitplane.reshard.boxes import Box
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Shard, placement_boxes
from refitplane.testing.model_shapes import tensor_specs


@dataclass(frozen=True)
class GpuLayout:
    """Trainer TP ranks on GPUs 0..trainer_tp-1, then one vLLM replica per entry of
    `replica_tps` on the next GPUs."""

    trainer_tp: int
    replica_tps: tuple[int, ...]

    @property
    def gpus(self) -> int:
        return self.trainer_tp + sum(self.replica_tps)


# The layouts the GPU benchmarks and tests name: TP1 → TP1 fits two GPUs, the others four.
GPU_LAYOUTS = {
    "tp1": GpuLayout(1, (1,)),
    "tp2": GpuLayout(2, (2,)),
    "2xtp1": GpuLayout(2, (1, 1)),
}


def vllm_tp_boxes(ts: TensorSpec, tp: int, ranks: range) -> dict[int, Box]:
    """vLLM's TP split of one checkpoint tensor: HF's, except that every expert's
    intermediate dimension is split too (vLLM without expert parallelism)."""
    if ".mlp.experts." not in ts.name:
        return tp_boxes(ts, tp, ranks)
    dim = 1 if ts.name.endswith("down_proj.weight") else 0
    mesh = DeviceMesh.create([tp], list(ranks), tensor=ts.name)
    return placement_boxes(ts.shape, mesh, [Shard(dim)], tensor=ts.name)


def model_layouts(shape: str, gpu_layout: GpuLayout, quant: str = "") -> tuple[Layout, Layout]:
    """(trainer layout on ranks 0..trainer_tp-1, generator layout on the ranks after them)
    for `shape`, its checkpoint quantized as `quant` (`model_shapes.QUANTS`)."""
    src, dst = LayoutBuilder(), LayoutBuilder()
    for ts in tensor_specs(shape, quant=quant):
        for r, box in tp_boxes(ts, gpu_layout.trainer_tp).items():
            src.add(ts, r, box)
        first = gpu_layout.trainer_tp
        for tp in gpu_layout.replica_tps:
            for r, box in vllm_tp_boxes(ts, tp, range(first, first + tp)).items():
                dst.add(ts, r, box)
            first += tp
    return src.build(), dst.build()
