"""What the vLLM GPU tests share: the layouts they run (each marked with the GPUs it needs),
the vLLM mark, the model shape they refit, and the greedy-generation prompt they compare
tokens on."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from refitplane.testing.model_layouts import GPU_LAYOUTS, GpuLayout

NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
PROMPT = (1, 2, 3, 4, 5, 6, 7)
NEW_TOKENS = 8
SHAPE = "qwen3-small"


def layout_params(*names: str) -> list[Any]:
    """`pytest.param(GpuLayout, id=name)` per layout, marked with the GPUs it takes."""
    return [
        pytest.param(GPU_LAYOUTS[n], id=n, marks=pytest.mark.gpu(count=GPU_LAYOUTS[n].gpus))
        for n in names
    ]


def world_args(layout: GpuLayout) -> dict[str, Any]:
    return {"trainer_ranks": layout.trainer_tp, "replica_tps": layout.replica_tps}
