"""Module names → canonical names: wrapper prefixes stripped, then the user's map."""

from __future__ import annotations

import pytest

from refitplane.trainer.layouts.names import canonical_name, strip_wrapper_prefixes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        (
            "_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ),
        ("_fsdp_wrapped_module.model.norm.weight", "model.norm.weight"),
        ("module._orig_mod.lm_head.weight", "lm_head.weight"),
        ("model.module_list.0.weight", "model.module_list.0.weight"),  # only a leading module.
    ],
)
def test_wrapper_prefixes_are_stripped(raw: str, clean: str) -> None:
    assert strip_wrapper_prefixes(raw) == clean


def test_mapping_renames_listed_names_and_keeps_the_rest() -> None:
    rename = {"transformer.wte.weight": "model.embed_tokens.weight"}
    assert canonical_name("_orig_mod.transformer.wte.weight", rename) == "model.embed_tokens.weight"
    assert canonical_name("model.norm.weight", rename) == "model.norm.weight"


def test_callable_can_drop_names() -> None:
    def only_weights(name: str) -> str | None:
        return name if name.endswith(".weight") else None

    assert canonical_name("model.x.bias", only_weights) is None
    assert canonical_name("_orig_mod.model.x.weight", only_weights) == "model.x.weight"
