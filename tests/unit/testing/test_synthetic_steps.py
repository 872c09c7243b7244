"""A synthetic optimizer step (`synthetic_weights.apply_step`) changes the same elements in
every process that replays it: the trainer (float32 default dtype), a vLLM worker checking
its weights, and vLLM's loader replaying the checkpoint for a fresh load, where the default
dtype is the model's (a bf16 draw picked other elements; the fresh-load oracle of
`benchmarks/ipc_refit.py --fresh-load` found it)."""

from __future__ import annotations

import pytest
import torch

from refitplane.testing.synthetic_weights import apply_step, replayed, synthetic


@pytest.mark.parametrize("step", [("flip", 0.01, 7), ("adamw", 1e-3, 7)])
def test_a_step_does_not_depend_on_the_default_dtype(step: tuple[str, float, int]) -> None:
    name, shape = "model.layers.0.mlp.up_proj.weight", (64, 96)
    want = replayed(name, shape, "bfloat16", "cpu", [step])
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as under vLLM's model loader
    try:
        got = replayed(name, shape, "bfloat16", "cpu", [step])
    finally:
        torch.set_default_dtype(saved)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_flip_changes_about_the_fraction_asked_and_only_the_lowest_bit() -> None:
    name, shape = "model.norm.weight", (4096,)
    start = synthetic(name, shape, "bfloat16", "cpu")
    flipped = start.clone()
    apply_step(name, flipped, ("flip", 0.05, 3))
    xor = start.view(torch.int16) ^ flipped.view(torch.int16)
    changed = int((xor != 0).sum())
    assert 100 < changed < 320  # ~205 expected
    assert set(xor[xor != 0].tolist()) == {1}
