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

Under expert parallelism an expert layer's loader is called for every expert of the
checkpoint and skips (returns without loading, `False` when asked for success) those not
in the rank's expert map; the recorder asks the layer's own mapping the same way and
records no load for them, so another rank's experts are not taken for this rank's.

Models that bypass `weight_loader` and write a parameter directly (`param.copy_(w)`,
`param.data[i] = w`: gpt-oss's experts and sinks, direct `default_weight_loader` calls) are
traced too: a write of a traced tensor into any parameter's storage is recorded instead of
performed. Nothing is ever written: recorders never call the real loaders.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

import torch
from torch.utils._pytree import tree_flatten, tree_map

from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import torch_dtype

log = logging.getLogger("refitplane.generator.load_trace")

_NO_LOADER = object()


# Writes into a destination tensor (args[0]) that a traced value may reach a parameter by.
_WRITES: Final = frozenset({torch.Tensor.copy_, torch.Tensor.__setitem__})


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
        if func in _WRITES and _DIRECT_WRITES is not None and args:
            param = _DIRECT_WRITES.param_of(args[0])
            if param is not None:  # a direct write into a parameter: record, do not write
                for source in sources:
                    _DIRECT_WRITES.hits.setdefault(source, set()).add(param)
                return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda x: _traced(x, sources) if isinstance(x, torch.Tensor) else x, out)


class _ParameterStorage:
    """Parameter name by the storage it lives in, so a write into a view of a parameter
    (`param.data[rows]`) is attributed to it. Persistent buffers count too: vLLM's
    `AutoWeightsLoader` loads checkpoint tensors into them (`default_weight_loader`), as
    the Transformers backend does with a router's `e_score_correction_bias`."""

    def __init__(self, model: torch.nn.Module, hits: dict[str, set[str]]) -> None:
        self.hits = hits
        self._by_storage: dict[int, str] = {}
        for name, param in model.named_parameters():
            if param.numel() and param.device.type != "meta":
                self._by_storage.setdefault(param.untyped_storage().data_ptr(), name)
        for name, buffer in persistent_buffers(model).items():
            if buffer.numel() and buffer.device.type != "meta":
                self._by_storage.setdefault(buffer.untyped_storage().data_ptr(), name)

    def param_of(self, tensor: Any) -> str | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        return self._by_storage.get(tensor.untyped_storage().data_ptr())


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every persistent buffer by name (what `state_dict` and vLLM's `AutoWeightsLoader`
    treat as loadable), each once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        for bname, buffer in module._buffers.items():
            if buffer is None or bname in module._non_persistent_buffers_set:
                continue
            if id(buffer) not in seen:
                seen.add(id(buffer))
                out[f"{path}.{bname}" if path else bname] = buffer
    return out


# Set while a trace runs (one at a time per process: vLLM workers are single-threaded).
_DIRECT_WRITES: _ParameterStorage | None = None


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
    with (
        _recording_loaders(model, hits),
        _recording_direct_writes(model, hits),
        current_config(vllm_config),
    ):
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
def _recording_direct_writes(model: torch.nn.Module, hits: dict[str, set[str]]) -> Iterator[None]:
    global _DIRECT_WRITES
    previous, _DIRECT_WRITES = _DIRECT_WRITES, _ParameterStorage(model, hits)
    try:
        yield
    finally:
        _DIRECT_WRITES = previous


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
                loader = saved[-1][1]
                recorder = _recorder(names[id(param)], hits, loader)
                param.weight_loader = recorder  # type: ignore[attr-defined]
        yield
    finally:
        for param, loader in saved:
            if loader is _NO_LOADER:
                param.__dict__.pop("weight_loader", None)
            else:
                param.weight_loader = loader  # type: ignore[attr-defined]


def _recorder(param_name: str, hits: dict[str, set[str]], loader: object) -> Callable[..., bool]:
    # Loaders are called positionally or by keyword (`param=`, `loaded_weight=`): look at
    # every argument for traced tensors.
    def record(*args: Any, **kwargs: Any) -> bool:
        if _skips_expert_not_held(loader, args, kwargs):
            return False  # what the real loader reports (when asked): nothing loaded
        leaves, _ = tree_flatten((args, kwargs))
        for leaf in leaves:
            for source in getattr(leaf, "sources", ()):
                hits.setdefault(source, set()).add(param_name)
        # Expert loaders report success; the model then stops trying other mappings.
        return True

    return record


def _skips_expert_not_held(loader: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the real `loader` would skip this call: an expert layer's loader (a method
    of a layer with vLLM's `_map_global_expert_id_to_local_expert_id`, FusedMoE /
    RoutedExperts in vLLM 0.26 and 0.32) called for a global `expert_id` that the layer's
    expert map does not place on this rank. Mirrors the loader's exceptions: a global
    input scale (`use_global_sf`) and gpt-oss's combined MXFP4 experts load on every rank.
    Anything unrecognised counts as a load (a spurious fallback is slow, a missed one wrong).
    """
    layer = getattr(loader, "__self__", None)
    to_local = getattr(layer, "_map_global_expert_id_to_local_expert_id", None)
    if not callable(loader) or not callable(to_local):
        return False
    try:
        call = inspect.signature(loader).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return False
    expert_id = call.get("expert_id")
    if not isinstance(expert_id, int) or isinstance(expert_id, bool):
        return False
    weight_name = str(call.get("weight_name", ""))
    quant_config = getattr(layer, "quant_config", None)
    if quant_config is not None and quant_config.get_name() == "gpt_oss_mxfp4":
        return False
    global_scale = "input_scale" in weight_name and bool(
        getattr(getattr(layer, "quant_method", None), "use_global_sf", False)
    )
    return not global_scale and int(to_local(expert_id)) == -1


@contextlib.contextmanager
def current_config(vllm_config: Any) -> Iterator[None]:
    """Some models read the current vLLM config while loading."""
    if vllm_config is None:
        yield
        return
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield
