"""Deterministic synthetic weights: every tensor's values come from its name, so any process
can regenerate what any box must hold (trainer ranks build their shards from them, vLLM
workers check what landed, without any extra transfer), and a checkpoint directory of them
for reference loads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refitplane.testing.model_shapes import tensor_specs, write_config


def write_checkpoint(
    path: Path, shape: str, dtype: str = "bfloat16", quant: str = "", device: str = "cuda:0"
) -> Path:
    """A loadable checkpoint directory holding exactly the synthetic weights the trainers
    hold (generated on `device`, as the trainers do), for reference loads."""
    from safetensors.torch import save_file

    write_config(path, shape, dtype, quant)
    state = {
        ts.name: synthetic(ts.name, ts.shape, ts.dtype, device).cpu()
        for ts in tensor_specs(shape, dtype, quant)
    }
    save_file(state, str(path / "model.safetensors"))
    return path


def synthetic(name: str, shape: Sequence[int], dtype: str, device: Any) -> Any:
    """Deterministic weights of one tensor (same values on any CUDA device; CPU differs).
    FP8 weights hold values of about unit size; their block scales are about 0.03, so the
    dequantized weights are of the same size as the unquantized ones."""
    import torch

    from refitplane.reshard.shards import torch_dtype

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")
    gen = torch.Generator(device=device).manual_seed(seed)
    if name.endswith(("k_scale", "v_scale")):  # KV-cache scales: positive, about 0.1
        return (0.05 + 0.1 * torch.rand((), generator=gen, device=device)).to(torch_dtype(dtype))
    if name.endswith("_scale_inv"):
        uniform = torch.rand(tuple(shape), generator=gen, device=device, dtype=torch.float32)
        return (0.02 + 0.02 * uniform).to(torch_dtype(dtype))
    values = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    if dtype.startswith("float8"):
        return (values * 0.5).to(torch_dtype(dtype))
    scale = 1.0 if name.endswith("norm.weight") else 0.02
    return (values * scale + (1.0 if name.endswith("norm.weight") else 0.0)).to(torch_dtype(dtype))
