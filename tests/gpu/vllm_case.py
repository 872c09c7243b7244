"""What the vLLM GPU tests share: their marks (four GPUs and vLLM installed), the model
shape they refit, and the greedy-generation prompt they compare tokens on."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_ON_FOUR_GPUS = [
    pytest.mark.gpu(count=4),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]
PROMPT = (1, 2, 3, 4, 5, 6, 7)
NEW_TOKENS = 8
SHAPE = "qwen3-small"
