from __future__ import annotations

import pytest

from refitplane.reshard.stages import MODULE, format_stage, stage_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("name", "stage"),
    [
        ("model.layers.3.self_attn.q_proj.weight", ("model.layers", 3)),
        ("model.layers.3.mlp.experts.17.gate_proj.weight", ("model.layers", 3)),
        ("model.layers.12.self_attn.k_scale", ("model.layers", 12)),
        ("backbone.layers.0.mixer.in_proj.weight", ("backbone.layers", 0)),
        ("visual.blocks.4.attn.qkv.weight", ("visual.blocks", 4)),
        ("model.embed_tokens.weight", ("model.embed_tokens", MODULE)),
        ("lm_head.weight", ("lm_head", MODULE)),
        ("model.norm.weight", ("model.norm", MODULE)),
        ("bias", ("", MODULE)),
        ("model.layers.2e3.weight", ("model.layers.2e3", MODULE)),  # not an index
    ],
)
def test_stage_of_a_canonical_name(name: str, stage: tuple[str, int]) -> None:
    assert stage_of(name) == stage


def test_layers_sort_by_index() -> None:
    names = ["model.layers.10.w", "model.layers.9.w", "model.layers.100.w", "model.layers.0.w"]
    assert [stage_of(n)[1] for n in sorted(names, key=stage_of)] == [0, 9, 10, 100]


def test_format_stage() -> None:
    assert format_stage(("model.layers", 3)) == "model.layers.3"
    assert format_stage(("model.norm", MODULE)) == "model.norm"
    assert format_stage(("", MODULE)) == "(top level)"
