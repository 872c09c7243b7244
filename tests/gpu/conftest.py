"""GPU tests run only where CUDA GPUs and nccl4py exist (the device machines, never CI)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest


def gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have_nccl = importlib.util.find_spec("nccl") is not None
    for item in items:
        if "gpu" not in item.keywords:
            continue
        need = item.get_closest_marker("gpu").kwargs.get("count", 1)  # type: ignore[union-attr]
        if gpus() < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s)"))
        elif not have_nccl:
            item.add_marker(pytest.mark.skip(reason="needs nccl4py"))


@pytest.fixture(scope="session")
def reload_reports() -> dict[str, dict[str, Any]]:
    """Case → what test_fresh_load_gpu.py's "auto" engine found comparing its receive with
    vLLM's own reload (`vllm_checks.reload_differences`), for test_model_coverage_gpu.py to
    judge without an engine start of its own when both run in one pytest process."""
    return {}
