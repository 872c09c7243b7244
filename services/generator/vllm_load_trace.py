"""Which vLLM parameters each checkpoint tensor lands in, found by vLLM's own loader.

The fail-safe path (`vllm_layout`'s fallback) must know, for a parameter no layer rule
describes, which checkpoint tensors vLLM's `load_weights` reads into it, without knowing
anything about the model. So ask the model: run its own `load_weights` over *traced meta
tensors* (no memory, no data), with every parameter's `weight_loader` swapped for a
recorder. Each traced tensor carries the names of the checkpoint tensors it was computed
from through every torch operation the model's loading code applies (`narrow`, `view`,
`chunk`, `cat`, casts, ...), so whatever the model does before calling a loader (renames,
stacked-parameter mappings, expert mappings, `hf_to_vllm_mapper`, transposes), the
recorder learns which checkpoint tensors reached which parameter.

Nothing is written: recorders never call the real loaders, and a loading path that bypasses
`weight_loader` and copies into a live parameter fails on the meta tensor before it writes
(copying out of a meta tensor raises). Such a tensor is then simply not reported.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import torch_dtype

log = logging.getLogger("refitplane.generator.load_trace")

_NO_LOADER = object()


class _Traced(torch.Tensor):
    """A tensor that remembers which checkpoint tensors it was computed from."""

    sources: frozenset[str]

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        sources = frozenset().union(*(getattr(x, "sources", frozenset()) for x in leaves))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda x: _traced(x, sources) if isinstance(x, torch.Tensor) else x, out)


def _traced(tensor: torch.Tensor, sources: frozenset[str]) -> _Traced:
    out = tensor.as_subclass(_Traced)
    out.sources = sources
    return out


def traced_checkpoint_tensor(spec: TensorSpec) -> torch.Tensor:
    """A meta tensor shaped like the checkpoint tensor `spec`, traced as coming from it."""
    empty = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device="meta")
    return _traced(empty, frozenset({spec.name}))


def trace_load_targets(
    model: torch.nn.Module,
    checkpoint: Mapping[str, TensorSpec],
    *,
    vllm_config: Any = None,
) -> dict[str, frozenset[str]]:
    """Checkpoint tensor name → the vLLM parameters (by `named_parameters` name) its load
    writes into. Tensors vLLM does not load (unknown to the model, skipped by it, or loaded
    outside `weight_loader`) are absent.

    One `load_weights` call over every tensor; if the model rejects one of them (some models
    raise on names they do not know) the tensors are traced one call each, so one bad name
    costs only itself.
    """
    hits: dict[str, set[str]] = {}
    with _recording_loaders(model, hits), _current_config(vllm_config):
        try:
            _load(model, checkpoint.values())
        except Exception as exc:  # noqa: BLE001 - any loader failure: retry name by name
            log.debug("tracing all checkpoint tensors at once failed (%s); one by one", exc)
            hits.clear()
            for spec in checkpoint.values():
                try:
                    _load(model, [spec])
                except Exception as one:  # noqa: BLE001 - vLLM does not load this tensor
                    log.debug("vLLM's load_weights rejects %s: %s", spec.name, one)
    return {name: frozenset(params) for name, params in hits.items()}


def _load(model: torch.nn.Module, specs: Iterable[TensorSpec]) -> None:
    weights = ((spec.name, traced_checkpoint_tensor(spec)) for spec in specs)
    model.load_weights(weights)  # type: ignore[operator]


@contextlib.contextmanager
def _recording_loaders(model: torch.nn.Module, hits: dict[str, set[str]]) -> Iterator[None]:
    """Swap every parameter's `weight_loader` for a recorder; restore them afterwards."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    saved: list[tuple[torch.nn.Parameter, object]] = []
    seen: set[int] = set()
    try:
        for module in model.modules():
            for maybe in module._parameters.values():
                if maybe is None or id(maybe) in seen:
                    continue
                param = maybe
                seen.add(id(param))
                saved.append((param, param.__dict__.get("weight_loader", _NO_LOADER)))
                param.weight_loader = _recorder(names[id(param)], hits)  # type: ignore[attr-defined]
        yield
    finally:
        for param, loader in saved:
            if loader is _NO_LOADER:
                param.__dict__.pop("weight_loader", None)
            else:
                param.weight_loader = loader  # type: ignore[attr-defined]


def _recorder(param_name: str, hits: dict[str, set[str]]) -> Callable[..., bool]:
    # Loaders are called positionally or by keyword (`param=`, `loaded_weight=`): look at
    # every argument for traced tensors.
    def record(*args: Any, **kwargs: Any) -> bool:
        leaves, _ = tree_flatten((args, kwargs))
        for leaf in leaves:
            for source in getattr(leaf, "sources", ()):
                hits.setdefault(source, set()).add(param_name)
        # Expert loaders report success; the model then stops trying other mappings.
        return True

    return record


@contextlib.contextmanager
def _current_config(vllm_config: Any) -> Iterator[None]:
    """Some models read the current vLLM config while loading."""
    if vllm_config is None:
        yield
        return
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield
