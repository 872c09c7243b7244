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
from refitplane.testing.cpu_memory import allocation_peak
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
    layout, served, _, part = describe_with_draft(worker, checkpoint_dir)
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
    norm = [(TARGET_NORM, state[TARGET_NORM])]
    # The norm's layer reloaded for the norm alone, twice: as a plain partial reload (every
    # layer under the root materialized), then as the mixed binding's does, told which
    # parameters were received in place (here: the rest of the layer, experts included).
    with allocation_peak() as unaware:
        reload_layers(target, worker.vllm_config, norm, [norm_root], partial=True)
    in_place = frozenset(
        n for n in layout.params if n.startswith(norm_root + ".") and n != TARGET_NORM
    )
    with allocation_peak() as told:
        reload_layers(
            target, worker.vllm_config, norm, [norm_root], partial=True, in_place=in_place
        )
    params = dict(target.named_parameters())
    after = kernel_tensors(worker, with_draft=True)
    return {
        "changed": sorted(n for n in before if after.get(n) != before[n]),
        "fast": sorted(part.layout.params),
        "fallback": sorted(fallback),
        "roots": sorted(by_root),
        "norm_bytes": _nbytes(params[TARGET_NORM]),
        "experts_bytes": sum(
            _nbytes(params[n]) for n in in_place if ".experts." in n and n in params
        ),
        "peak_unaware": unaware.peak,
        "peak_in_place": told.peak,
    }


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def whole_bucket_peaks(worker: Any, checkpoint_dir: str) -> dict[str, Any]:
    """Apply the target's whole checkpoint (what the worker loaded) as one staged bucket, as
    mode "staged" applies a rank's share at finish: through one reload over every layer
    (`reload_layers` given all roots), and through `LayerReloader`, a layer at a time; then
    its largest layer alone. Returns each one's allocation peak, the bytes given per group
    of layers, and the kernel tensors that changed (none may: the bytes are the loaded
    ones)."""
    from refitplane.generator.vllm_staging import LayerReloader, root_groups
    from refitplane.reshard.staged import StagedBucket
    from refitplane.reshard.stages import stage_of
    from tests.support.vllm_checks import describe_with_draft

    target = worker.model_runner.get_model()
    layout, _, _, _ = describe_with_draft(worker, checkpoint_dir)
    state = load_checkpoint(checkpoint_dir)
    roots_of = layout.tensor_roots()
    weights = {n: state[n] for n in roots_of if n in state}
    groups = root_groups(weights, roots_of)
    sizes = sorted(sum(_nbytes(weights[n]) for n in names) for _, names in groups)
    largest = max(groups, key=lambda g: sum(_nbytes(weights[n]) for n in g[1]))[1]
    before = kernel_tensors(worker, with_draft=True)

    reloader = LayerReloader(target, worker.vllm_config, roots_of, live=False)

    def apply(names: list[str]) -> int:
        bucket = StagedBucket(0, (stage_of(names[0]), stage_of(names[-1])), tuple(names), 0)
        with allocation_peak() as measured:
            reloader(bucket, {n: weights[n] for n in names})
        return measured.peak

    every_layer = sorted(root for group_roots, _ in groups for root in group_roots)
    with allocation_peak() as one:
        reload_layers(target, worker.vllm_config, weights.items(), every_layer)
    every = apply(list(weights))
    alone = apply(largest)
    after = kernel_tensors(worker, with_draft=True)
    return {
        "changed": sorted(n for n in before if after.get(n) != before[n]),
        "groups": len(groups),
        "group_bytes": sizes,
        "peak_one_reload": one.peak,
        "peak_layer_at_a_time": every,
        "peak_largest_alone": alone,
    }
