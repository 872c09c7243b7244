"""transformers-5 fused expert tensors → per-expert checkpoint boxes, as views."""

from __future__ import annotations

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import full_box, to_slices
from refitplane.trainer.layouts.fused_experts import is_fused_experts, unfuse_experts
from refitplane.trainer.layouts.held import HeldSlice

pytestmark = pytest.mark.unit

E, F, H = 3, 4, 5
PREFIX = "model.layers.2.mlp.experts"


def per_expert(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: what transformers' save_pretrained writes."""
    out = {}
    for e in range(E):
        out[f"{PREFIX}.{e}.gate_proj.weight"] = gate_up[e, :F]
        out[f"{PREFIX}.{e}.up_proj.weight"] = gate_up[e, F:]
        out[f"{PREFIX}.{e}.down_proj.weight"] = down[e]
    return out


@pytest.mark.parametrize(
    "box",
    [
        ((0, E), (0, 2 * F), (0, H)),  # whole tensor
        ((1, 3), (0, 2 * F), (0, H)),  # an FSDP/EP shard of experts
        ((0, 2), (2, 7), (1, 4)),  # rows straddling the gate/up boundary, some columns
        ((2, 3), (F, 2 * F), (0, H)),  # up rows only
    ],
)
def test_gate_up_boxes_reproduce_the_checkpoint(box: tuple[tuple[int, int], ...]) -> None:
    gate_up = torch.randn(E, 2 * F, H)
    down = torch.randn(E, H, F)
    local = gate_up[to_slices(box)].clone()  # what one rank stores
    held = HeldSlice(f"{PREFIX}.gate_up_proj", (E, 2 * F, H), box, local)
    ckpt = per_expert(gate_up, down)
    pieces = unfuse_experts(held)
    assert sum(p.view.numel() for p in pieces) == local.numel()
    for p in pieces:
        assert p.shape == (F, H)
        assert torch.equal(p.view, ckpt[p.name][to_slices(p.box)])
        assert p.view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def test_down_proj_boxes_reproduce_the_checkpoint() -> None:
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    box = ((1, 3), (0, H), (2, 4))
    held = HeldSlice(f"{PREFIX}.down_proj", (E, H, F), box, down[to_slices(box)])
    ckpt = per_expert(gate_up, down)
    pieces = unfuse_experts(held)
    assert [p.name for p in pieces] == [
        f"{PREFIX}.1.down_proj.weight",
        f"{PREFIX}.2.down_proj.weight",
    ]
    for p in pieces:
        assert p.shape == (H, F)
        assert p.box == ((0, H), (2, 4))
        assert torch.equal(p.view, ckpt[p.name][to_slices(p.box)])


def test_other_names_pass_through() -> None:
    t = torch.zeros(2, 2)
    held = HeldSlice("model.layers.0.mlp.gate_proj.weight", (2, 2), full_box((2, 2)), t)
    assert unfuse_experts(held) == [held]
    assert not is_fused_experts(held.name)
    assert is_fused_experts(f"{PREFIX}.gate_up_proj")


def test_malformed_fused_tensors_are_rejected() -> None:
    odd = HeldSlice(f"{PREFIX}.gate_up_proj", (E, 7, H), full_box((E, 7, H)), torch.zeros(E, 7, H))
    with pytest.raises(LayoutError, match="halves") as err:
        unfuse_experts(odd)
    assert err.value.tensor == f"{PREFIX}.gate_up_proj"
    flat = HeldSlice(f"{PREFIX}.down_proj", (E, H), full_box((E, H)), torch.zeros(E, H))
    with pytest.raises(LayoutError, match="3-D"):
        unfuse_experts(flat)
