"""Pinned results: the layouts, digests and plan of a scaled-down DeepSeek-like job (PP, DP,
TP and EP meshes that differ, experts, FP8 block scales, replicated norms, uneven chunks,
overlapping holdings, hosts) must stay byte-for-byte what they were when the values below
were recorded. Layout and planner speed-ups must not change a plan: digests are stored and
compared across coordinator versions, and ranks keep plans by digest."""

from __future__ import annotations

import hashlib
import json

import pytest

from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec, merge_layouts
from refitplane.reshard.layout_json import dump_layout, parse_layout
from refitplane.reshard.placements import DeviceMesh, Placement, Replicate, Shard, placement_boxes
from refitplane.reshard.plan import plan_to_dict
from refitplane.reshard.planner import build_plan

pytestmark = pytest.mark.unit

PP, DP, TP, EP, EXPERTS, LAYERS = 2, 2, 2, 4, 8, 4
GEN_REPLICAS, GEN_TP = 2, 3
TRAIN = PP * DP * TP


def _tensors(layer: int) -> list[tuple[TensorSpec, str]]:
    p = f"model.layers.{layer}"
    out = [
        (TensorSpec.create(f"{p}.self_attn.q_proj.weight", [24, 16], "bfloat16"), "col"),
        (TensorSpec.create(f"{p}.self_attn.q_proj.weight_scale_inv", [1, 1], "float32"), "rep"),
        (TensorSpec.create(f"{p}.self_attn.o_proj.weight", [16, 24], "float8_e4m3fn"), "row"),
        (TensorSpec.create(f"{p}.self_attn.kv_a_proj.weight", [7, 16], "bfloat16"), "col"),
        (TensorSpec.create(f"{p}.input_layernorm.weight", [16], "float32"), "rep"),
        (TensorSpec.create(f"{p}.mlp.gate.e_score_correction_bias", [EXPERTS], "float32"), "rep"),
        (TensorSpec.create(f"{p}.scalar", [], "float32"), "rep"),
    ]
    for e in range(EXPERTS):
        out.append((TensorSpec.create(f"{p}.mlp.experts.{e}.w", [10, 16], "bfloat16"), f"e{e}"))
    return out


def _layouts() -> tuple[Layout, Layout]:
    src, dst = LayoutBuilder(), LayoutBuilder()
    stages = [
        DeviceMesh.create([DP, TP], list(range(s * DP * TP, (s + 1) * DP * TP))) for s in range(PP)
    ]
    gens = [
        DeviceMesh.create([GEN_TP], list(range(TRAIN + r * GEN_TP, TRAIN + (r + 1) * GEN_TP)))
        for r in range(GEN_REPLICAS)
    ]

    def add(b: LayoutBuilder, spec: TensorSpec, mesh: DeviceMesh, pl: list[Placement]) -> None:
        for rank, box in placement_boxes(spec.shape, mesh, pl).items():
            b.add(spec, rank, box)

    for layer in range(LAYERS):
        stage = layer * PP // LAYERS
        for spec, split in _tensors(layer):
            if split.startswith("e"):
                e = int(split[1:])
                full = tuple((0, n) for n in spec.shape)
                src.add(spec, stage * DP * TP + e * EP // EXPERTS, full)
                for r in range(GEN_REPLICAS):
                    dst.add(spec, TRAIN + r * GEN_TP + e % GEN_TP, full)
                continue
            tp: Placement = Replicate()
            if split == "col" and spec.shape:
                tp = Shard(0)
            elif split == "row":
                tp = Shard(1)
            add(src, spec, stages[stage], [Replicate(), tp])
            for mesh in gens:
                add(dst, spec, mesh, [tp])
    # Overlapping holdings: rank 0 holds the whole embedding, ranks 1-3 row blocks of it.
    embed = TensorSpec.create("model.embed_tokens.weight", [30, 8], "bfloat16")
    src.add(embed, 0, ((0, 30), (0, 8)))
    for i, r in enumerate((1, 2, 3)):
        src.add(embed, r, ((i * 10, i * 10 + 10), (0, 8)))
    for mesh in gens:
        add(dst, embed, mesh, [Shard(0)])
    return src.build(), dst.build()


def _sha(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


HOSTS = {r: f"host-{r // 4}" for r in range(TRAIN + GEN_REPLICAS * GEN_TP)}

PINNED = {
    "source_digest": "c6e5df708fc6ec0637149d8936b4e4fd76c8acd73779bff680ccbf9228dd1af5",
    "target_digest": "1057a719a638f36441880747d4dabc9f5873d1eccff23e2d46c0750d94c23e0e",
    "plan_digest": "1e9d668c930678b78c248f2a84688a8091fea3393119ca923abefaec3546558a",
    "plan_sha": "95656e6bff7c51892371b37356b96008e46c0e0777963d3fc6bf46acbde7241f",
    "hosts_plan_digest": "09d6d3d88f01a9980079af1e00bc8ce7cecc3590a9435fa65096ca1f2e570243",
    "hosts_plan_sha": "20c9932c142683043a6ab938164922af69c0531a6cf2c514aa3c256bbec57418",
}


def _results() -> dict[str, str]:
    source, target = _layouts()
    plan = build_plan(source, target)
    with_hosts = build_plan(source, target, hosts=HOSTS)
    return {
        "source_digest": source.digest,
        "target_digest": target.digest,
        "plan_digest": plan.digest,
        "plan_sha": _sha(plan_to_dict(plan)),
        "hosts_plan_digest": with_hosts.digest,
        "hosts_plan_sha": _sha(plan_to_dict(with_hosts)),
    }


def test_layouts_digests_and_plans_are_pinned() -> None:
    assert _results() == PINNED


def test_layouts_rebuilt_any_way_have_the_same_digest() -> None:
    source, target = _layouts()
    for layout in (source, target):
        assert parse_layout(dump_layout(layout)).digest == layout.digest
        per_rank = [layout.for_rank(r) for r in layout.ranks()]
        assert merge_layouts(per_rank).digest == layout.digest
        shifted = layout.relabel({r: r + 100 for r in layout.ranks()})
        back = shifted.relabel({r + 100: r for r in layout.ranks()})
        assert back.digest == layout.digest
        assert back.tensors == layout.tensors
