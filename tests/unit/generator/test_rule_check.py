"""The start-up check of fast-path rules (`vllm_rule_check`) on a torch module that loads
like a vLLM model: a rule that says where the loader puts every element is verified; a
loader that permutes rows, transforms values or writes padding the rule does not know is a
mismatch that sends the class to the fallback path; nothing live is ever written."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import PaddingRegion, ParamLayout, Placement
from refitplane.generator.vllm_rule_check import (
    PINNED_RULES,
    RuleCheckPolicy,
    check_rules,
    reject_unproven,
    role_of,
)
from refitplane.generator.vllm_rule_parts import DescribedParam
from refitplane.reshard.layout import TensorSpec

pytestmark = pytest.mark.unit


class StackedQK(torch.nn.Module):
    """`qk` rows [q (4) | k (2) | padding (2)]; the loader zero-fills the padding rows."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.full((8, 3), 7.0), requires_grad=False)
        self.qk.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        rows = (0, 4) if shard == "q" else (4, 6)
        param.data[rows[0] : rows[1]].copy_(loaded)
        param.data[6:].zero_()


class Toy(torch.nn.Module):
    def __init__(self, transform: str = "") -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for layer in self.layers:
            layer.attn = StackedQK()
        self.transform = transform

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            index, proj = int(name.split(".")[1]), name.split(".")[2]
            if proj == "q" and self.transform == "reverse rows":
                tensor = tensor.flip(0)
            if proj == "k" and self.transform == "negate":
                tensor = -tensor
            param = self.layers[index].attn.qk
            param.weight_loader(param, tensor, proj)
            loaded.add(f"layers.{index}.attn.qk")
        return loaded


def described(index: int, padding: bool = True) -> list[DescribedParam]:
    q = TensorSpec.create(f"layers.{index}.q.weight", [4, 3], "float32")
    k = TensorSpec.create(f"layers.{index}.k.weight", [2, 3], "float32")
    placements = (
        Placement(q.name, ((0, 4), (0, 3)), ((0, 4), (0, 3))),
        Placement(k.name, ((0, 2), (0, 3)), ((4, 6), (0, 3))),
    )
    pad = (PaddingRegion(((6, 8), (0, 3)), "test padding"),) if padding else ()
    param = ParamLayout(f"layers.{index}.attn.qk", (8, 3), "float32", placements, pad)
    return [DescribedParam(param, (q, k))]


def fast() -> dict[str, list[DescribedParam]]:
    return {f"layers.{i}.attn": described(i) for i in range(2)}


def test_a_rule_that_says_where_every_element_lands_is_verified() -> None:
    model = Toy()
    before = [p.detach().clone() for p in model.parameters()]
    (check,) = check_rules(model, fast(), RuleCheckPolicy())
    assert (check.layer_class, check.status, check.reason) == ("StackedQK", "verified", "")
    # One layer per role: layers.0 and layers.1 are the same role.
    assert check.samples == ("layers.0.attn",)
    # Two runs (one per dimension) over the whole 8 x 3 parameter.
    assert check.elements == 2 * 24
    assert check.peak_bytes > 0
    # The check loads into integer shadows only: the live parameters are untouched.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("transform", "expected"),
    [
        (
            "reverse rows",
            "writes layers.0.q.weight index 3 along dimension 0 at layers.0.attn.qk[0:1, 0:1]",
        ),
        ("negate", "at layers.0.attn.qk[4:5, 0:1]"),
    ],
)
def test_a_loader_transform_the_rule_does_not_model_is_a_mismatch(
    transform: str, expected: str
) -> None:
    model = Toy(transform)
    before = [p.detach().clone() for p in model.parameters()]
    layers = fast()
    rejected: dict[str, str] = {}
    (check,) = reject_unproven(model, layers, rejected, RuleCheckPolicy())
    assert check.status == "mismatch"
    assert expected in check.reason, check.reason
    # Every layer of the class moves to the fallback path, with the reason.
    assert layers == {}
    assert sorted(rejected) == ["layers.0.attn", "layers.1.attn"]
    assert all("StackedQK rule failed the start-up check" in r for r in rejected.values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_element_the_rule_calls_padding_but_the_loader_fills_is_a_mismatch() -> None:
    model = Toy()
    layers = fast()
    # Say q holds only 3 rows and row 3 is padding: the loader writes q's row 3 there.
    param = layers["layers.0.attn"][0].param
    q, k = param.placements
    short = Placement(q.hf_name, ((0, 3), (0, 3)), ((0, 3), (0, 3)))
    padding = (PaddingRegion(((3, 4), (0, 3)), "wrong"), *param.padding)
    wrong = ParamLayout(param.name, param.shape, param.dtype, (short, k), padding)
    layers["layers.0.attn"] = [DescribedParam(wrong, layers["layers.0.attn"][0].specs)]
    (check,) = check_rules(model, layers, RuleCheckPolicy())
    assert check.status == "mismatch"
    assert "at layers.0.attn.qk[3:4, 0:1]" in check.reason, check.reason
    assert "the rule says nothing" in check.reason, check.reason


def test_a_check_above_the_memory_bound_is_not_guessed_at() -> None:
    (check,) = check_rules(Toy(), fast(), RuleCheckPolicy(max_bytes=16))
    assert check.status == "mismatch"
    assert "REFIT_RULE_CHECK_MAX_BYTES" in check.reason


def test_only_classes_a_test_pins_may_skip_the_check() -> None:
    with pytest.raises(LayoutError, match="StackedQK"):
        RuleCheckPolicy(skip=frozenset({"StackedQK"}))
    policy = RuleCheckPolicy(skip=frozenset({"QKVParallelLinear"}))
    assert policy.skip <= set(PINNED_RULES)
    assert check_rules(Toy(), fast(), RuleCheckPolicy(enabled=False)) == []


def test_every_pinning_test_exists() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for cls, test in PINNED_RULES.items():
        assert (root / test).is_file(), (cls, test)


def test_roles_fold_layer_numbers() -> None:
    assert role_of("model.layers.12.mlp.experts") == "model.layers.N.mlp.experts"
    assert role_of("model.layers.3.self_attn.o_proj") != role_of("model.layers.3.mlp.down_proj")
    assert role_of("lm_head") == "lm_head"
