"""vLLM's layerwise reload reads every weight loader's `__name__` (to tell its own wrappers
apart) and raises on a loader without one, half-way through a refit: MiniMax-M2's loaders
are `functools.partial` objects. `_name_anonymous_loaders` names them before the reload, and
replaces a loader that cannot take a name by a named function calling it."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch

from refitplane.generator.vllm_reload import _name_anonymous_loaders

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


class _SlottedLoader:
    """A callable that takes no new attributes (no `__dict__`), as C-implemented ones."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        self.calls.append(loaded)
        param.data.copy_(loaded)


def _load(param: torch.Tensor, loaded: torch.Tensor, scale: float) -> None:
    param.data.copy_(loaded * scale)


def test_every_loader_has_a_name_and_still_loads() -> None:
    layer = torch.nn.Module()
    layer.partial = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    layer.partial.weight_loader = functools.partial(_load, scale=2.0)  # type: ignore[attr-defined]
    layer.slotted = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    slotted = _SlottedLoader()
    layer.slotted.weight_loader = slotted  # type: ignore[attr-defined]

    _name_anonymous_loaders([layer])

    assert layer.partial.weight_loader.__name__ == "_load"  # type: ignore[attr-defined]
    assert layer.slotted.weight_loader.__name__ == "weight_loader"  # type: ignore[attr-defined]
    layer.partial.weight_loader(layer.partial, torch.ones(2))  # type: ignore[attr-defined]
    layer.slotted.weight_loader(layer.slotted, torch.full((2,), 3.0))  # type: ignore[attr-defined]
    assert torch.equal(layer.partial, torch.full((2,), 2.0))
    assert torch.equal(layer.slotted, torch.full((2,), 3.0))
    assert len(slotted.calls) == 1
