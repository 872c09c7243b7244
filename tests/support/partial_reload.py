"""A live refit's fallback reload, run inside a vLLM worker (`llm.collective_rpc`).

In live mode (GPUs: unquantized linears and Triton MoE are read as loaded) the fast-path
parameters are received in place, and only the fallback tensors go through vLLM's layerwise
reload, over the whole decoder layer they feed (`vllm_layout.layer_root`) with `partial`
set: the layer's other modules keep the bytes received in place. DeepSeek-V3's MTP draft is
such a layer on vLLM 0.26: its router (`mtp_block.mlp.gate`, with `e_score_correction_bias`)
falls back, its routed experts are on the fast path.

`fallback_reload_in_place` applies, in a worker that loaded `checkpoint_dir` (DeepSeek-V3
with one MTP layer, served with its MTP draft), the draft's fallback tensors exactly as that
live refit does, and one target layer's input norm alone; every byte put in is what the
engine loaded, so no kernel tensor may change.
"""

from __future__ import annotations

from typing import Any

from refitplane.generator.vllm_reload import reload_layers
from refitplane.models.tiny import load_checkpoint
from refitplane.testing.kernel_tensors import kernel_tensors

# A target tensor whose layer (a MoE layer with a noaux_tc router) gets nothing else.
TARGET_NORM = "model.layers.1.input_layernorm.weight"


def fallback_reload_in_place(worker: Any, checkpoint_dir: str) -> dict[str, Any]:
    """Reload the MTP draft's fallback tensors (layer by layer, `partial` as a live refit
    does) and the target's `TARGET_NORM` alone (its layer as root), all from the checkpoint
    the worker loaded. Returns the kernel tensors that changed (target and `draft.*`), the
    draft's fast-path parameters and its fallback tensors."""
    from refitplane.protocol.draft import DRAFT_PREFIX
    from tests.support.vllm_checks import describe_with_draft

    target = worker.model_runner.get_model()
    _, served, _, part = describe_with_draft(worker, checkpoint_dir)
    state = load_checkpoint(checkpoint_dir)
    before = kernel_tensors(worker, with_draft=True)

    roots_of = part.layout.tensor_roots()
    fallback = part.layout.fallback_tensors
    by_root: dict[str, list[str]] = {}
    for name in fallback:
        for root in roots_of[name]:
            by_root.setdefault(root, []).append(name)
    for root, names in sorted(by_root.items()):
        weights = [
            (n.removeprefix(DRAFT_PREFIX), state[n.removeprefix(DRAFT_PREFIX)]) for n in names
        ]
        reload_layers(served.model, served.vllm_config, weights, [root], partial=True)
    norm_root = TARGET_NORM.rsplit(".", 2)[0]
    reload_layers(
        target, worker.vllm_config, [(TARGET_NORM, state[TARGET_NORM])], [norm_root], partial=True
    )

    after = kernel_tensors(worker, with_draft=True)
    return {
        "changed": sorted(n for n in before if after.get(n) != before[n]),
        "fast": sorted(part.layout.params),
        "fallback": sorted(fallback),
        "roots": sorted(by_root),
    }
