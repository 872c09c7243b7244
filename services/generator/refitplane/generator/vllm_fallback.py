"""The fail-safe path: which vLLM layers are loaded through vLLM's own loader, and from what.

`describe_vllm_model` tries the fast-path rule of every layer (module owning parameters);
a layer whose rule is missing or refuses it is *rejected* with the rule's reason. Here the
rejected layers get their inputs: the checkpoint tensors vLLM's `load_weights` reads into
their parameters, found by tracing the model's own loading code (`vllm_load_trace`).

Decisions are per layer, never per parameter: vLLM's layerwise reload processes a layer once
all its parameters are loaded, so a layer must be reloaded whole. And a checkpoint tensor
that feeds a rejected layer is received whole; any fast-path layer it also feeds (or a
checkpoint tensor the fast rules did not claim but vLLM loads into a fast-path layer: the
rule missed an input) joins the fallback path as well, until nothing changes.

Tracing is cheap but not free, so it runs only when some layer was rejected, and first only
over checkpoint tensors no fast-path rule claims; the claimed ones are traced too only if
some fallback parameter is still unexplained.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refitplane.errors import LayoutError
from refitplane.generator.checkpoint_index import CheckpointIndex
from refitplane.generator.vllm_layer_rules import loader_template
from refitplane.generator.vllm_layout import FallbackParam
from refitplane.generator.vllm_load_trace import persistent_buffers, trace_load_targets
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import dtype_name

log = logging.getLogger("refitplane.generator.fallback")

# Checkpoint tensors by name (read from the checkpoint: exact), or a function returning
# them, called only when some layer takes the fallback path.
CheckpointSource = (
    Mapping[str, TensorSpec]
    | CheckpointIndex
    | Callable[[], Mapping[str, TensorSpec] | CheckpointIndex]
)

# Quantization scales vLLM creates with a default value and loads only if the checkpoint
# has them (KV-cache and activation scales); every other parameter must be loaded, as vLLM
# itself requires of unquantized checkpoints.
OPTIONAL_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale", "input_scale")


@dataclass(frozen=True, slots=True)
class Layer:
    """A module with the parameters it registers itself."""

    path: str
    module: torch.nn.Module
    owned: Mapping[str, torch.nn.Parameter]

    def param_names(self) -> list[str]:
        return [f"{self.path}.{p}" if self.path else p for p in self.owned]


@dataclass(frozen=True, slots=True)
class FallbackPlan:
    """Fallback parameters, the checkpoint tensors they load from, and the fast-path layers
    that had to join them."""

    params: dict[str, FallbackParam]
    specs: dict[str, TensorSpec]
    joined: dict[str, str]
    # Parameters of fallback layers that no checkpoint tensor loads into.
    kept: tuple[str, ...] = ()


def resolve_index(checkpoint: CheckpointSource | None) -> CheckpointIndex | None:
    """The checkpoint index a source stands for (calling it if it is a function)."""
    if checkpoint is None:
        return None
    index = checkpoint() if callable(checkpoint) else checkpoint
    return index if isinstance(index, CheckpointIndex) else CheckpointIndex(index)


def plan_fallback(
    model: torch.nn.Module,
    layers: Mapping[str, Layer],
    rejected: Mapping[str, str],
    claimed: set[str],
    index: CheckpointIndex | None,
    *,
    vllm_config: Any = None,
) -> FallbackPlan:
    """Resolve the fallback path for the `rejected` layers (path → reason); `claimed` are
    the checkpoint tensors the fast-path rules of the other layers read."""
    first = layers[next(iter(rejected))].param_names()[0]
    if index is None:
        raise LayoutError(
            f"no fast path ({rejected[next(iter(rejected))]}), and no checkpoint index was "
            "given to find the tensors vLLM loads into it",
            tensor=first,
        )
    specs = dict(index.specs)
    owner_of = {name: path for path, layer in layers.items() for name in layer.param_names()}
    reasons = dict(rejected)

    def fallback_param_names() -> set[str]:
        return {n for path in reasons for n in layers[path].param_names()}

    unclaimed = {n: s for n, s in specs.items() if n not in claimed}
    with _vanished_restored(layers.values()):
        targets = dict(trace_load_targets(model, unclaimed, vllm_config=vllm_config))
        fed = {p for params in targets.values() for p in params}
        if fallback_param_names() - fed:
            more = {n: s for n, s in specs.items() if n in claimed}
            targets.update(trace_load_targets(model, more, vllm_config=vllm_config))

    joined: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        fallback = fallback_param_names()
        for name, params in targets.items():
            # An unclaimed tensor vLLM loads into a fast-path layer means its rule missed an
            # input, when the index is the checkpoint's own; names rebuilt from the
            # transformers model may just be other spellings of claimed tensors.
            pulls = bool(params & fallback) or (name not in claimed and index.exact)
            if not pulls:
                continue
            for param in sorted(params):
                path = owner_of.get(param)
                if path is None or path in reasons:
                    continue
                why = (
                    f"checkpoint tensor {name!r} loads into it and into fallback parameters"
                    if name in claimed
                    else f"vLLM also loads checkpoint tensor {name!r} into it, which its rule "
                    "does not describe"
                )
                reasons[path] = joined[path] = why
                changed = True

    fallback = fallback_param_names()
    sources: dict[str, list[str]] = {}
    for name, params in sorted(targets.items()):
        for param in params & fallback:
            sources.setdefault(param, []).append(name)
    out: dict[str, FallbackParam] = {}
    kept: list[str] = []
    for path in reasons:
        layer = layers[path]
        for pname, live in layer.owned.items():
            name = f"{path}.{pname}" if path else pname
            if name not in sources:
                if not pname.endswith(OPTIONAL_SCALES):
                    raise LayoutError(
                        f"no fast path ({reasons[path]}), and tracing vLLM's load_weights "
                        "found no checkpoint tensor that loads into it",
                        tensor=name,
                    )
                # A quantization scale the checkpoint does not carry: vLLM's own loader
                # leaves its default too, so it is not part of a refit.
                kept.append(name)
                continue
            shape, dtype = loader_format(layer.module, pname, live)
            out[name] = FallbackParam(name, shape, dtype, reasons[path], tuple(sources[name]))
    if kept:
        log.warning(
            "refitplane: no checkpoint tensor loads into %d parameters (%s%s); they keep "
            "their values across refits, as under vLLM's own loader",
            len(kept),
            ", ".join(kept[:4]),
            " ..." if len(kept) > 4 else "",
        )
    out.update(_loaded_buffers(model, targets, reasons))
    needed = {s for p in out.values() for s in p.sources}
    return FallbackPlan(out, {n: specs[n] for n in sorted(needed)}, joined, tuple(kept))


def _loaded_buffers(
    model: torch.nn.Module, targets: Mapping[str, frozenset[str]], reasons: Mapping[str, str]
) -> dict[str, FallbackParam]:
    """Persistent buffers of fallback layers that `load_weights` fills from the checkpoint
    (vLLM's Transformers backend keeps a router's `e_score_correction_bias` as one): they
    are refit with their layer, from the checkpoint tensors the trace saw written into
    them, in their live shape and dtype (`default_weight_loader` copies as it is)."""
    buffers = persistent_buffers(model)
    sources: dict[str, list[str]] = {}
    for name, written in sorted(targets.items()):
        for target in written:
            if target in buffers and target.rpartition(".")[0] in reasons:
                sources.setdefault(target, []).append(name)
    out: dict[str, FallbackParam] = {}
    for target, names in sources.items():
        buffer = buffers[target]
        reason = reasons[target.rpartition(".")[0]]
        shape = tuple(int(n) for n in buffer.shape)
        out[target] = FallbackParam(target, shape, dtype_name(buffer.dtype), reason, tuple(names))
    return out


@contextlib.contextmanager
def _vanished_restored(layers: Iterable[Layer]) -> Iterator[None]:
    """Register, on the meta device, the parameters post-load processing deleted (their
    loader-format records), so the model's `load_weights` finds them while it is traced;
    remove them afterwards."""
    added: list[tuple[torch.nn.Module, str]] = []
    try:
        for layer in layers:
            for pname, template in layer.owned.items():
                if pname in layer.module._parameters:
                    continue
                layer.module.register_parameter(pname, template)
                added.append((layer.module, pname))
        yield
    finally:
        for module, pname in added:
            module._parameters.pop(pname, None)


def loader_format(
    owner: torch.nn.Module, pname: str, live: torch.Tensor
) -> tuple[tuple[int, ...], str]:
    """The shape and dtype `load_weights` writes a parameter in."""
    template = loader_template(owner, pname, live)
    tensor = live if template is None else template
    return tuple(int(n) for n in tensor.shape), dtype_name(tensor.dtype)
