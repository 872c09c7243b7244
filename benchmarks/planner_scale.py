#!/usr/bin/env python3
"""Planner at DeepSeek-V3 / Kimi-K2 scale: ~100k tensors, 256 trainer ranks → 128 generator ranks.

Model: DeepSeek-V3 shapes in FP8 (float8_e4m3fn weights with float32 128x128 block
`weight_scale_inv`), 61 layers (3 dense + 58 MoE), 256 routed experts + 1 shared expert per
MoE layer, MLA attention, vocab 129280. `--experts 384` gives a Kimi-K2-like expert count.

Trainer (256 ranks): PP8; inside a stage, dense weights on a (DP4 x TP8) mesh
(column-parallel Shard(0), row-parallel Shard(1), norms/MLA down-projections replicated),
experts on EP32 (expert-TP 1) over the same 32 ranks: the two meshes differ, as in Megatron.
Generator (128 ranks): 4 replicas x TP32; dense TP32, experts EP32 within each replica.

    python benchmarks/planner_scale.py [--experts 256] [--box-by-box] [--json out.json]

Prints a table: CPU time to build the layouts, hash them and plan (the first refit of a new
layout does all three), peak RSS, tensors, pieces, links, bytes, imbalance. Target: all
three <= 2 s and < 1 GiB RSS on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from collections.abc import Iterator

from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Placement, Replicate, Shard, placement_boxes
from refitplane.reshard.planner import build_plan

H, VOCAB, LAYERS, DENSE_LAYERS = 7168, 129280, 61, 3
Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD, HEADS = 1536, 512, 64, 128, 128, 128
MOE_I, DENSE_I = 2048, 18432
PP, TP, DP, EP = 8, 8, 4, 32
GEN_TP, GEN_REPLICAS = 32, 4
TRAIN_WORLD = PP * TP * DP  # 256


def _weight(name: str, rows: int, cols: int) -> Iterator[tuple[TensorSpec, str]]:
    """An FP8 weight and its block scale; `kind` says how TP splits it."""
    yield TensorSpec.create(f"{name}.weight", [rows, cols], "float8_e4m3fn"), "w"
    yield (
        TensorSpec.create(
            f"{name}.weight_scale_inv", [-(-rows // 128), -(-cols // 128)], "float32"
        ),
        "s",
    )


def layer_tensors(layer: int, experts: int) -> Iterator[tuple[TensorSpec, str]]:
    """(spec, split) with split in col / row / rep / expert."""
    p = f"model.layers.{layer}"
    for spec, _ in _weight(f"{p}.self_attn.q_a_proj", Q_LORA, H):
        yield spec, "rep"
    yield TensorSpec.create(f"{p}.self_attn.q_a_layernorm.weight", [Q_LORA], "bfloat16"), "rep"
    for spec, _ in _weight(f"{p}.self_attn.q_b_proj", HEADS * (NOPE + ROPE), Q_LORA):
        yield spec, "col"
    for spec, _ in _weight(f"{p}.self_attn.kv_a_proj_with_mqa", KV_LORA + ROPE, H):
        yield spec, "rep"
    yield TensorSpec.create(f"{p}.self_attn.kv_a_layernorm.weight", [KV_LORA], "bfloat16"), "rep"
    for spec, _ in _weight(f"{p}.self_attn.kv_b_proj", HEADS * (NOPE + V_HEAD), KV_LORA):
        yield spec, "col"
    for spec, _ in _weight(f"{p}.self_attn.o_proj", H, HEADS * V_HEAD):
        yield spec, "row"
    yield TensorSpec.create(f"{p}.input_layernorm.weight", [H], "bfloat16"), "rep"
    yield TensorSpec.create(f"{p}.post_attention_layernorm.weight", [H], "bfloat16"), "rep"
    if layer < DENSE_LAYERS:
        for proj, (r, c), split in (
            ("gate", (DENSE_I, H), "col"),
            ("up", (DENSE_I, H), "col"),
            ("down", (H, DENSE_I), "row"),
        ):
            for spec, _ in _weight(f"{p}.mlp.{proj}_proj", r, c):
                yield spec, split
        return
    yield TensorSpec.create(f"{p}.mlp.gate.weight", [experts, H], "bfloat16"), "rep"
    yield TensorSpec.create(f"{p}.mlp.gate.e_score_correction_bias", [experts], "float32"), "rep"
    for proj, (r, c), split in (
        ("gate", (MOE_I, H), "col"),
        ("up", (MOE_I, H), "col"),
        ("down", (H, MOE_I), "row"),
    ):
        for spec, _ in _weight(f"{p}.mlp.shared_experts.{proj}_proj", r, c):
            yield spec, split
    for e in range(experts):
        for proj, (r, c) in (("gate", (MOE_I, H)), ("up", (MOE_I, H)), ("down", (H, MOE_I))):
            for spec, _ in _weight(f"{p}.mlp.experts.{e}.{proj}_proj", r, c):
                yield spec, f"expert:{e}"


def _tp_placement(split: str, spec: TensorSpec) -> Placement:
    if split == "col" and spec.shape:
        return Shard(0)
    if split == "row" and len(spec.shape) == 2:
        return Shard(1)
    return Replicate()


def build_layouts(experts: int, *, box_by_box: bool = False) -> tuple[Layout, Layout]:
    """`box_by_box`: every box added with `LayoutBuilder.add` (as a caller that has boxes,
    not placements, would), instead of `add_placements`; the layouts are the same."""
    src, dst = LayoutBuilder(), LayoutBuilder()

    def add_placements(
        b: LayoutBuilder, spec: TensorSpec, mesh: DeviceMesh, placements: list[Placement]
    ) -> None:
        if not box_by_box:
            b.add_placements(spec, mesh, placements)
            return
        for rank, box in placement_boxes(spec.shape, mesh, placements).items():
            b.add(spec, rank, box)

    per_stage = -(-LAYERS // PP)
    stage_meshes = [
        DeviceMesh.create([DP, TP], list(range(s * DP * TP, (s + 1) * DP * TP))) for s in range(PP)
    ]
    gen_meshes = [
        DeviceMesh.create(
            [GEN_TP], list(range(TRAIN_WORLD + r * GEN_TP, TRAIN_WORLD + (r + 1) * GEN_TP))
        )
        for r in range(GEN_REPLICAS)
    ]
    experts_per_train_rank = experts // EP
    experts_per_gen_rank = experts // GEN_TP
    # An expert is whole on one rank of its stage's EP group, and on one rank of each
    # generator replica: a one-rank mesh, and a mesh of one rank per replica, replicated.
    expert_src_meshes = [
        [DeviceMesh.create([1], [s * DP * TP + k]) for k in range(EP)] for s in range(PP)
    ]
    expert_dst_meshes = [
        DeviceMesh.create(
            [GEN_REPLICAS], [TRAIN_WORLD + r * GEN_TP + k for r in range(GEN_REPLICAS)]
        )
        for k in range(GEN_TP)
    ]
    replicated: list[Placement] = [Replicate()]

    def place(spec: TensorSpec, split: str, stage: int) -> None:
        if split.startswith("expert:"):
            e = int(split.split(":")[1])
            add_placements(
                src, spec, expert_src_meshes[stage][e // experts_per_train_rank], replicated
            )
            add_placements(dst, spec, expert_dst_meshes[e // experts_per_gen_rank], replicated)
            return
        p = _tp_placement(split, spec)
        add_placements(src, spec, stage_meshes[stage], [Replicate(), p])
        for mesh in gen_meshes:
            add_placements(dst, spec, mesh, [p])

    for layer in range(LAYERS):
        for spec, split in layer_tensors(layer, experts):
            place(spec, split, layer // per_stage)
    place(TensorSpec.create("model.embed_tokens.weight", [VOCAB, H], "bfloat16"), "col", 0)
    place(TensorSpec.create("lm_head.weight", [VOCAB, H], "bfloat16"), "col", PP - 1)
    place(TensorSpec.create("model.norm.weight", [H], "bfloat16"), "rep", PP - 1)
    return src.build(), dst.build()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument(
        "--box-by-box",
        action="store_true",
        help="build the layouts with LayoutBuilder.add per box instead of add_placements",
    )
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

    # CPU time per phase (the target is CPU seconds on one core; the machine may be shared,
    # which inflates wall time), wall time beside it.
    w0, c0 = time.perf_counter(), time.process_time()
    source, target = build_layouts(args.experts, box_by_box=args.box_by_box)
    w1, c1 = time.perf_counter(), time.process_time()
    digests = (source.digest, target.digest)
    w2, c2 = time.perf_counter(), time.process_time()
    plan = build_plan(source, target)
    w3, c3 = time.perf_counter(), time.process_time()
    stats = plan.stats()
    t_stats = time.process_time() - c3
    c_layout, c_digest, c_plan, c_all = c1 - c0, c2 - c1, c3 - c2, c3 - c0
    rss = _rss_mib()
    result = {
        "experts": args.experts,
        "box_by_box": args.box_by_box,
        "tensors": len(target),
        "trainer_ranks": len(source.ranks()),
        "generator_ranks": len(target.ranks()),
        "pieces": stats.num_pieces,
        "links": stats.num_links,
        "total_gib": stats.total_bytes / 2**30,
        "send_imbalance": stats.send_imbalance,
        "recv_imbalance": stats.recv_imbalance,
        "layout_build_cpu_s": c_layout,
        "layout_digest_cpu_s": c_digest,
        "plan_cpu_s": c_plan,
        "all_three_cpu_s": c_all,
        "all_three_wall_s": w3 - w0,
        "wall_s": {"layouts": w1 - w0, "digests": w2 - w1, "plan": w3 - w2},
        "load_average": os.getloadavg()[0],
        "stats_cpu_s": t_stats,
        "peak_rss_mib": rss,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores (pinned to 1)",
        "layout_digests": digests,
        "plan_digest": plan.digest,
    }
    rows = [
        ("tensors", f"{result['tensors']:,}"),
        ("trainer -> generator ranks", f"{result['trainer_ranks']} -> {result['generator_ranks']}"),
        ("pieces / links", f"{result['pieces']:,} / {result['links']:,}"),
        ("bytes moved (all replicas)", f"{result['total_gib']:.1f} GiB"),
        (
            "send / recv imbalance",
            f"{result['send_imbalance']:.3f} / {result['recv_imbalance']:.3f}",
        ),
        ("build layouts, CPU", f"{c_layout:.2f} s"),
        ("layout digests, CPU", f"{c_digest:.2f} s"),
        ("plan (build_plan), CPU", f"{c_plan:.2f} s"),
        ("all three, CPU", f"{c_all:.2f} s   (target <= 2 s)"),
        ("all three, wall", f"{w3 - w0:.2f} s   (load average {os.getloadavg()[0]:.1f})"),
        ("plan stats, CPU", f"{t_stats:.2f} s"),
        ("peak RSS", f"{rss:.0f} MiB   (target < 1024 MiB)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
