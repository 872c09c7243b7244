"""Reshard scenarios run by real multi-process Gloo tests.

Each scenario builds a source layout (trainer-like) and a target layout (generator-like)
over distinct group ranks. Every global tensor's content is a deterministic function of
its name (random bytes, so fp8/bf16 compare bit-exactly), so any process can compute what
any box must hold without communicating.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refitplane.reshard.boxes import Box, box_shape, to_slices
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Placement, Replicate, Shard, placement_boxes
from refitplane.reshard.shards import LocalShards, torch_dtype


def global_tensor(spec: TensorSpec) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(spec.name.encode()).digest()[:6], "little")
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (spec.nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(torch_dtype(spec.dtype)).view(spec.shape)


def _add(
    builder: LayoutBuilder, spec: TensorSpec, mesh: DeviceMesh, placements: list[Placement]
) -> None:
    for rank, box in placement_boxes(spec.shape, mesh, placements, tensor=spec.name).items():
        builder.add(spec, rank, box)


def _mesh(shape: list[int], first: int) -> DeviceMesh:
    n = 1
    for d in shape:
        n *= d
    return DeviceMesh.create(shape, list(range(first, first + n)))


def _tensors(prefix: str, dtype: str = "bfloat16") -> dict[str, TensorSpec]:
    return {
        "col": TensorSpec.create(f"{prefix}.col.weight", [48, 20], dtype),
        "row": TensorSpec.create(f"{prefix}.row.weight", [20, 50], dtype),
        "norm": TensorSpec.create(f"{prefix}.norm.weight", [20], "float32"),
        "fp8": TensorSpec.create(f"{prefix}.proj.weight", [33, 16], "float8_e4m3fn"),
        "scale": TensorSpec.create(f"{prefix}.proj.weight_scale_inv", [3, 1], "float32"),
    }


def _tp_layout(
    builder: LayoutBuilder, specs: dict[str, TensorSpec], mesh: DeviceMesh, tp_dim: int = 0
) -> None:
    """Megatron/vLLM-like TP over the last mesh dim (Replicate over the others)."""
    rep: list[Placement] = [Replicate()] * (len(mesh.shape) - 1)
    _add(builder, specs["col"], mesh, [*rep, Shard(0)])
    _add(builder, specs["row"], mesh, [*rep, Shard(1)])
    _add(builder, specs["norm"], mesh, [*rep, Replicate()])
    _add(builder, specs["fp8"], mesh, [*rep, Shard(0)])
    _add(builder, specs["scale"], mesh, [*rep, Replicate()])


@dataclass(frozen=True)
class Scenario:
    name: str
    source: Layout
    target: Layout

    @property
    def world_size(self) -> int:
        return len(self.source.ranks()) + len(self.target.ranks())


def tp2_to_tp3() -> Scenario:
    specs = _tensors("model.layers.0")
    src, dst = LayoutBuilder(), LayoutBuilder()
    _tp_layout(src, specs, _mesh([2], 0))
    _tp_layout(dst, specs, _mesh([3], 2))
    return Scenario("tp2_to_tp3", src.build(), dst.build())


def pp2tp2_to_tp4() -> Scenario:
    src, dst = LayoutBuilder(), LayoutBuilder()
    for layer in range(2):
        specs = _tensors(f"model.layers.{layer}")
        _tp_layout(src, specs, _mesh([2], 2 * layer))  # stage 0: ranks 0,1; stage 1: 2,3
        _tp_layout(dst, specs, _mesh([4], 4))
    return Scenario("pp2tp2_to_tp4", src.build(), dst.build())


def tp4_to_two_tp1() -> Scenario:
    specs = _tensors("model.layers.0")
    src, dst = LayoutBuilder(), LayoutBuilder()
    _tp_layout(src, specs, _mesh([4], 0))
    for replica in range(2):
        _tp_layout(dst, specs, _mesh([1], 4 + replica))
    return Scenario("tp4_to_two_tp1", src.build(), dst.build())


def dp2tp2_to_tp1() -> Scenario:
    """Two data-parallel replicas of a TP2 trainer: the planner must split the load."""
    specs = _tensors("model.layers.0")
    src, dst = LayoutBuilder(), LayoutBuilder()
    _tp_layout(src, specs, _mesh([2, 2], 0))  # mesh (dp, tp)
    _tp_layout(dst, specs, _mesh([1], 4))
    return Scenario("dp2tp2_to_tp1", src.build(), dst.build())


def irregular_boxes() -> Scenario:
    """Explicit, uneven, multi-box holdings (e.g. interleaved fused QKV groups)."""
    spec = TensorSpec.create("model.layers.0.self_attn.qkv.weight", [30, 12], "bfloat16")
    src, dst = LayoutBuilder(), LayoutBuilder()
    for box in [((0, 4), (0, 12)), ((10, 17), (0, 12)), ((25, 30), (0, 12))]:
        src.add(spec, 0, box)
    for box in [((4, 10), (0, 12)), ((17, 25), (0, 5))]:
        src.add(spec, 1, box)
    src.add(spec, 2, ((17, 25), (5, 12)))
    dst.add(spec, 3, ((0, 30), (0, 7)))
    dst.add(spec, 4, ((3, 21), (7, 12)))
    dst.add(spec, 4, ((21, 30), (7, 12)))
    return Scenario("irregular_boxes", src.build(), dst.build())


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    f.__name__: f
    for f in (tp2_to_tp3, pp2tp2_to_tp4, tp4_to_two_tp1, dp2tp2_to_tp1, irregular_boxes)
}


def make_shards(layout: Layout, rank: int, *, fill: bool, fused: bool = True) -> LocalShards:
    """Local storage for `rank`: sources filled with the true values, targets with garbage.

    With `fused`, all boxes of one tensor on a rank live in one flat buffer, as views with
    non-trivial offsets (like fused vLLM parameters), and 2-d boxes of the `.row.` tensors
    are stored transposed, so their views are non-contiguous.
    """
    shards = LocalShards()
    for t in layout:
        boxes = t.boxes.get(rank, ())
        if not boxes:
            continue
        dtype = torch_dtype(t.spec.dtype)
        full = global_tensor(t.spec) if fill else None
        numel = [int(torch.Size(box_shape(b)).numel()) for b in boxes]
        flat = torch.empty(sum(numel) + 3, dtype=dtype)
        flat.view(torch.uint8).fill_(0xA5)
        offset = 3 if fused else 0
        for box, n in zip(boxes, numel, strict=True):
            shape = box_shape(box)
            if fused and ".row." in t.spec.name and len(shape) == 2:
                view = flat[offset : offset + n].view(shape[1], shape[0]).t()
            else:
                view = flat[offset : offset + n].view(shape)
            if full is not None:
                view.copy_(full[to_slices(box)])
            shards.add(t.spec, box, view)
            offset += n
    return shards


def check_received(layout: Layout, rank: int, shards: LocalShards) -> list[str]:
    """Every needed box of `rank` holds exactly the true bytes; returns the mismatches."""
    bad = []
    for t in layout:
        full = global_tensor(t.spec)
        for box in t.boxes.get(rank, ()):
            got = shards.view(t.spec.name, box).contiguous().view(torch.uint8)
            want = full[to_slices(box)].contiguous().view(torch.uint8)
            if not torch.equal(got, want):
                bad.append(f"{t.spec.name}{list(box)}")
    return bad


def boxes_of(layout: Layout, rank: int) -> list[tuple[str, Box]]:
    return [(t.spec.name, b) for t in layout for b in t.boxes.get(rank, ())]
