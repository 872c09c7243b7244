"""GPU tests run only where CUDA GPUs and nccl4py exist (the device machines, never CI)."""

from __future__ import annotations

import importlib.util

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
