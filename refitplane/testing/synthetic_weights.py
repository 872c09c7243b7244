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


# Layout dtype names → safetensors header codes.
_SAFETENSORS_CODES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def write_sparse_checkpoint(
    path: Path, shape: str, dtype: str = "bfloat16", quant: str = ""
) -> Path:
    """A checkpoint directory whose `model.safetensors` is valid but sparse: the header of
    every tensor the trainers hold, then a hole (zeros) where their bytes would be, so it
    takes no disk and no time at any size. vLLM started with dummy weights never reads it;
    the generator reads checkpoint tensor names from its header, as from a real checkpoint
    (with no files at all it falls back to the transformers model's names, which miss FP8
    block scales of MoE experts)."""
    import json

    write_config(path, shape, dtype, quant)
    header: dict[str, Any] = {}
    offset = 0
    for ts in tensor_specs(shape, dtype, quant):
        header[ts.name] = {
            "dtype": _SAFETENSORS_CODES[ts.dtype],
            "shape": list(ts.shape),
            "data_offsets": [offset, offset + ts.nbytes],
        }
        offset += ts.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with (path / "model.safetensors").open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
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


# A change the benchmark makes to the synthetic weights, replayed anywhere from its name:
# ("flip", fraction, seed) flips the lowest bit of about `fraction` of the elements (so
# exactly those change); ("adamw", lr, seed) is one real `torch.optim.AdamW` step (fp32
# master weights from the current ones, a seeded normal gradient, weight decay 0.01) cast
# back to the tensor's dtype, the changed pattern an optimizer step leaves in bf16.
Step = tuple[str, float, int]


def apply_step(name: str, full: Any, step: Step) -> None:
    """Apply `step` in place to tensor `name`'s full value `full` (same result on any
    CUDA device for the same input)."""
    import torch

    kind, amount, seed = step
    base_seed = int.from_bytes(hashlib.sha256(f"{name}/{seed}".encode()).digest()[:6], "little")
    gen = torch.Generator(device=full.device).manual_seed(base_seed)
    if kind == "flip":
        # float32 named: under vLLM's loader the default dtype is the model's, and a bf16
        # draw would pick other elements (`synthetic_loader` replays steps there).
        picked = (
            torch.rand(full.shape, generator=gen, device=full.device, dtype=torch.float32) < amount
        )
        words = full.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[full.element_size()])
        words[picked] ^= 1
        return
    if kind != "adamw":
        raise ValueError(f"unknown step kind {kind!r}")
    master = torch.nn.Parameter(full.float())
    master.grad = torch.randn(full.shape, generator=gen, device=full.device, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        [master], lr=amount, weight_decay=0.01, foreach=False, fused=False
    )
    optimizer.step()
    full.copy_(master.detach())


def replayed(
    name: str, shape: Sequence[int], dtype: str, device: Any, steps: Sequence[Step]
) -> Any:
    """Tensor `name` after `steps`, from its synthetic start."""
    full = synthetic(name, shape, dtype, device)
    for step in steps:
        apply_step(name, full, step)
    return full
