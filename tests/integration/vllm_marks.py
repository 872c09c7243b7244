"""The marks every test against a real vllm-cpu engine or server carries: `vllm` and
`integration` for selection, a timeout that covers engine start-up on two busy cores, and a
clean skip where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_CPU = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu)"),
]
