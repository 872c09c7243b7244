"""Describing a live vLLM model (`describe_vllm_model`) as a `VllmLayout`, and binding its
storage as shard views (`vllm_shards`).

Inside a vLLM worker: every layer with a fast-path rule (`vllm_layer_rules`, checked at
start against vLLM's own `load_weights`: `vllm_rule_check`) is described as boxes of
checkpoint tensors; every other one takes the fallback path (`vllm_fallback`). Checkpoint
names come from the model's `hf_to_vllm_mapper` inverted, fused modules from its
packed-modules mapping, parameters vLLM replaced after loading are followed to their
loader-format templates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards

if TYPE_CHECKING:
    from refitplane.generator.vllm_fallback import CheckpointSource
    from refitplane.generator.vllm_rule_check import RuleCheckPolicy
    from refitplane.generator.vllm_rule_parts import DescribedParam
from typing import TYPE_CHECKING

from refitplane.generator.vllm_layout import VllmLayout, VllmRanks, check_param_cover

if TYPE_CHECKING:
    from refitplane.generator.vllm_layout import FallbackParam, PaddingView, ParamLayout


def vllm_ranks() -> VllmRanks:
    """This worker's ranks, read from vLLM's `parallel_state` (inside a vLLM worker only)."""
    from vllm.distributed import parallel_state as ps

    pp = ps.get_pp_group()
    dp = ps.get_dp_group()
    return VllmRanks(
        tp_rank=int(ps.get_tensor_model_parallel_rank()),
        tp_size=int(ps.get_tensor_model_parallel_world_size()),
        pp_rank=int(pp.rank_in_group),
        pp_size=int(pp.world_size),
        dp_rank=int(dp.rank_in_group),
        dp_size=int(dp.world_size),
    )


def describe_vllm_model(
    model: torch.nn.Module,
    *,
    ranks: VllmRanks | None = None,
    packed_modules: Mapping[str, Sequence[str]] | None = None,
    to_hf_name: Callable[[str], str] | None = None,
    checkpoint: CheckpointSource | None = None,
    vllm_config: Any = None,
    fallback: bool = True,
    skip_rules: Sequence[str] = (),
    rule_check: RuleCheckPolicy | None = None,
    shared_with: torch.nn.Module | None = None,
) -> VllmLayout:
    """The loader-format layout of every parameter of a vLLM model on this worker.

    `packed_modules` maps a fused vLLM module name to the checkpoint modules it stacks
    (default: the model's `packed_modules_mapping` over the usual `qkv_proj` / `gate_up_proj`);
    `to_hf_name` maps a vLLM parameter name to its checkpoint name for models whose
    `hf_to_vllm_mapper` renames prefixes (default: the names agree, as for Llama and Qwen).

    Layers without a fast path take the fallback path; `checkpoint` (checkpoint tensor name
    → spec, or a function returning them, called only if some layer needs the fallback)
    lists the tensors to trace vLLM's loader with. `fallback=False` makes every layer
    without a fast path an error instead; `skip_rules` (layer class names) sends layers of
    those classes to the fallback path as if they had no rule. Every rule left is checked
    against the model's own `load_weights` first (`vllm_rule_check`, as `rule_check` says;
    default: on): a class whose rule does not say where the loader puts each element takes
    the fallback path. Parameters whose memory is also a parameter of `shared_with` are
    left out, described by neither path: a speculative draft's view of its target's
    embedding or LM head (EAGLE, MTP), which the target's layout covers and whose tensor the
    draft's checkpoint may not even hold.
    """
    from refitplane.generator.vllm_fallback import Layer, plan_fallback, resolve_index
    from refitplane.generator.vllm_layer_rules import check_loader_format, describe_layer, has_rule
    from refitplane.generator.vllm_rule_check import reject_unproven
    from refitplane.generator.vllm_rule_parts import LayerContext

    index = resolve_index(checkpoint)
    names = frozenset(index.specs) if index is not None and index.exact else None
    ctx = LayerContext(
        ranks=ranks if ranks is not None else vllm_ranks(),
        packed=_packed_modules(model, packed_modules),
        to_hf_name=to_hf_name or _inverse_of_mapper(model, names),
        self_fused=_self_fused_modules(model),
    )
    layers: dict[str, Layer] = {}
    fast: dict[str, list[DescribedParam]] = {}
    rejected: dict[str, str] = {}
    owners = parameter_owners(model, shared_with=shared_with)
    for module_path, module, owned in _with_vanished(model, owners, has_rule):
        layers[module_path] = Layer(module_path, module, owned)
        if type(module).__name__ in skip_rules:
            rejected[module_path] = f"the {type(module).__name__} rule is switched off"
            continue
        try:
            layer_described = describe_layer(ctx, module_path, module, owned)
            for d in layer_described:
                check_param_cover(d.param)
                check_loader_format(module, d.param)
        except LayoutError as exc:
            if not fallback:
                raise
            rejected[module_path] = exc.message
        else:
            fast[module_path] = layer_described
    if index is not None and index.exact:
        # A rule naming tensors the checkpoint does not have (or has in another shape) does
        # not fit this model (gpt-oss stores its experts fused): its layer falls back.
        for path in list(fast):
            problem = _not_in_checkpoint(fast[path], index.specs)
            if problem:
                rejected[path] = problem
                del fast[path]
    checks = reject_unproven(model, fast, rejected, rule_check, vllm_config=vllm_config)
    fallback_params: dict[str, FallbackParam] = {}
    kept: tuple[str, ...] = ()
    specs: dict[str, TensorSpec] = {}
    if rejected:
        claimed = {spec.name for described in fast.values() for d in described for spec in d.specs}
        plan = plan_fallback(model, layers, rejected, claimed, index, vllm_config=vllm_config)
        for path in plan.joined:
            fast.pop(path, None)
        fallback_params, kept = plan.params, plan.kept
        specs.update(plan.specs)
    params: dict[str, ParamLayout] = {}
    for layer_params in fast.values():
        for described in layer_params:
            params[described.param.name] = described.param
            for spec in described.specs:
                known = specs.setdefault(spec.name, spec)
                if known != spec:
                    raise LayoutError(
                        f"described as {list(spec.shape)} {spec.dtype} by "
                        f"{described.param.name!r} and as {list(known.shape)} {known.dtype} "
                        "elsewhere",
                        tensor=spec.name,
                    )
    layout = VllmLayout(
        ranks=ctx.ranks,
        specs=specs,
        params=params,
        fallback=fallback_params,
        kept=kept,
        rule_checks=tuple(checks),
    )
    layout.check()
    return layout


def vllm_shards(
    model: torch.nn.Module,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    layout: VllmLayout | None = None,
    ranks: VllmRanks | None = None,
    packed_modules: Mapping[str, Sequence[str]] | None = None,
    to_hf_name: Callable[[str], str] | None = None,
) -> tuple[LocalShards, list[PaddingView]]:
    """This worker's shard views and padding regions of the fast-path parameters (the
    fallback path's whole tensors are staged by `vllm_staging.bind_receive`).

    Views go into the model's live parameters wherever the kernels read them as loaded (the
    zero-copy receive path, `vllm_live.live_storage`); `params` (vLLM parameter name →
    loader-format tensor) supplies storage for the others, e.g. a staging copy
    (`VllmLayout.allocate`) that is then loaded through vLLM's layerwise reload. A parameter
    that is neither writable in place nor given fails, naming the parameter and the reason.
    `layout` is the model's description if already made (else it is described here).
    """
    from refitplane.generator.vllm_live import live_storage

    if layout is None:
        layout = describe_vllm_model(
            model, ranks=ranks, packed_modules=packed_modules, to_hf_name=to_hf_name
        )
    live = live_storage(model, layout)
    storage = {**live.writable, **(params or {})}
    missing = [name for name in layout.params if name not in storage]
    if missing:
        reasons = "; ".join(f"{n}: {live.blocked.get(n, 'no storage')}" for n in missing[:3])
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise LayoutError(
            f"{len(missing)} parameters cannot be received into in place and no storage was "
            f"given for them: {reasons}{more}; pass a loader-format copy as params= and "
            "load it through vLLM's layerwise reload",
            tensor=missing[0],
            field="params",
        )
    return layout.bind(storage)


_DEFAULT_PACKED: Mapping[str, Sequence[str]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _same_name(name: str) -> str:
    return name


def _inverse_of_mapper(
    model: torch.nn.Module, checkpoint_names: frozenset[str] | None = None
) -> Callable[[str], str]:
    """vLLM parameter name → checkpoint name, undoing the renames of the model's
    `hf_to_vllm_mapper` that are one-to-one: prefixes (Nemotron-H's `backbone.` →
    `model.`), dotted substrings (gpt-oss's `.self_attn.` → `.attn.`, Nemotron-H's
    `embeddings` → `embed_tokens`) and suffixes. Models without a mapper keep their names.
    What this cannot undo shows up as a fast-path name the checkpoint lacks, and that layer
    takes the fallback path. A mapper may accept several spellings (Mixtral's loads both
    `w1` and `gate_proj` as `w1`): with the checkpoint's names known, a vLLM name the
    checkpoint itself has is kept."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return _same_name

    def one_to_one(mapping: Mapping[str, str | None]) -> dict[str, str]:
        targets = [new for new in mapping.values() if new is not None]
        return {
            new: orig
            for orig, new in mapping.items()
            if new is not None and targets.count(new) == 1
        }

    prefixes = one_to_one(getattr(mapper, "orig_to_new_prefix", {}) or {})
    substrings = one_to_one(getattr(mapper, "orig_to_new_substr", {}) or {})
    suffixes = one_to_one(getattr(mapper, "orig_to_new_suffix", {}) or {})

    def to_hf(name: str) -> str:
        undone = undo(name)
        if checkpoint_names is not None and undone not in checkpoint_names:
            return name if name in checkpoint_names else undone
        return undone

    def undo(name: str) -> str:
        for new, orig in prefixes.items():
            if name == new or name.startswith(new + "."):
                name = orig + name[len(new) :]
                break
        for new, orig in substrings.items():
            if new.startswith(".") and new.endswith("."):  # whole components: `.attn.`
                name = f".{name}.".replace(new, orig)[1:-1]
            elif "." not in new:  # one whole component: `embed_tokens`, never part of one
                name = ".".join(orig if p == new else p for p in name.split("."))
        for new, orig in suffixes.items():
            if name.endswith(new):
                return name[: -len(new)] + orig
        return name

    return to_hf


def _not_in_checkpoint(described: Sequence[DescribedParam], index: Mapping[str, TensorSpec]) -> str:
    """Why a layer's described tensors do not match the checkpoint, or ""."""
    for d in described:
        for spec in d.specs:
            have = index.get(spec.name)
            if have is None:
                return f"its rule reads checkpoint tensor {spec.name!r}, which the checkpoint does not have"
            if have.shape != spec.shape:
                return (
                    f"its rule reads checkpoint tensor {spec.name!r} as {list(spec.shape)}, "
                    f"the checkpoint has {list(have.shape)}"
                )
            if have.dtype != spec.dtype:
                # vLLM keeps some parameters in another dtype than the checkpoint (GLM-4-MoE
                # and MiniMax-M2 routers in float32): the trainer sends what the checkpoint
                # holds, and vLLM's loader casts it exactly as on a load.
                return (
                    f"vLLM keeps {d.param.name!r} in {d.param.dtype}, the checkpoint stores "
                    f"{spec.name!r} in {have.dtype}: vLLM's loader casts it"
                )
    return ""


def _self_fused_modules(model: torch.nn.Module) -> frozenset[str]:
    """Fused projections whose checkpoint tensor is stored fused under the module's own
    name: Mamba2's `in_proj` ([z | x | B | C | dt]) and `conv1d` ([x | B | C]) when vLLM
    builds them as merged column-parallel layers (groups divisible by TP)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    fused: set[str] = set()
    for path, module in model.named_modules():
        if type(module).__name__ != "MambaMixer2":
            continue
        for child in ("in_proj", "conv1d"):
            if type(getattr(module, child, None)) is MergedColumnParallelLinear:
                fused.add(f"{path}.{child}" if path else child)
    return frozenset(fused)


def _packed_modules(
    model: torch.nn.Module, given: Mapping[str, Sequence[str]] | None
) -> dict[str, tuple[str, ...]]:
    if given is not None:
        return {k: tuple(v) for k, v in given.items()}
    own = getattr(model, "packed_modules_mapping", None) or {}
    return {k: tuple(v) for k, v in {**_DEFAULT_PACKED, **own}.items()}


def parameter_owners(
    model: torch.nn.Module, *, shared_with: torch.nn.Module | None = None
) -> list[tuple[str, torch.nn.Module, dict[str, torch.nn.Parameter]]]:
    """Each module with the parameters it registers itself, every parameter exactly once,
    less those whose memory is also a parameter of `shared_with` (`storage_key`).

    A parameter registered by several modules (tied `lm_head` → `embed_tokens`, an MoE gate
    reachable as `mlp.gate` and `mlp.experts.gate`) belongs to the first module in
    `named_modules()` order — the name `named_parameters()` reports — except that an
    embedding wins over an LM head, whose checkpoint tensor a tied model does not have.

    Parameters that post-load processing *derived* from loaded ones are left out: they are
    not loaded from the checkpoint, and the processing that made them runs again after a
    refit (MLA attention's `W_UV` / `W_UK_T`, made from `kv_b_proj`).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    others = set() if shared_with is None else storage_keys(shared_with)
    owners: dict[int, tuple[str, torch.nn.Module, str]] = {}
    for path, module in model.named_modules():
        derived = _derived_parameters(module)
        for pname, param in module.named_parameters(recurse=False):
            if pname in derived or storage_key(param) in others:
                continue
            current = owners.get(id(param))
            if current is None or (
                isinstance(current[1], ParallelLMHead) and not isinstance(module, ParallelLMHead)
            ):
                owners[id(param)] = (path, module, pname)
    grouped: dict[str, tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]] = {}
    for path, module, pname in owners.values():
        entry = grouped.setdefault(path, (module, {}))
        entry[1][pname] = getattr(module, pname)
    return [(path, module, owned) for path, (module, owned) in grouped.items()]


def storage_keys(module: torch.nn.Module) -> set[tuple[int, int, tuple[int, ...]]]:
    """Where `module`'s parameters live (`storage_key`), meta and empty ones left out."""
    return {key for p in module.parameters() if (key := storage_key(p)) is not None}


def storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    """Where a tensor's elements live (storage, offset, shape): equal for two parameters
    that are one memory, whatever module paths register them; None for meta / empty."""
    if tensor.is_meta or tensor.numel() == 0:
        return None
    return (
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
    )


def _with_vanished(
    model: torch.nn.Module,
    owners: list[tuple[str, torch.nn.Module, dict[str, torch.nn.Parameter]]],
    has_rule: Callable[[torch.nn.Module], bool],
) -> list[tuple[str, torch.nn.Module, dict[str, torch.nn.Parameter]]]:
    """`owners` plus, for layers without a fast-path rule, the parameters `create_weights`
    made that post-load processing deleted (their loader-format record stands in for them):
    vLLM 0.26's FP8 attention loads `k_scale` / `v_scale` from the checkpoint, folds them
    into its cache scales and deletes them; a refit must load them again the same way."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    except ImportError:
        return owners
    out = {path: (module, owned) for path, module, owned in owners}
    for path, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is None or has_rule(module):
            continue
        vanished = {
            name: _as_parameter(template)
            for name, template in info.restore_metadata[0].items()
            if name not in module._parameters and name not in SKIP_TENSORS
        }
        if vanished:
            entry = out.setdefault(path, (module, {}))
            entry[1].update(vanished)
    return [(path, module, owned) for path, (module, owned) in out.items()]


def _as_parameter(template: torch.Tensor) -> torch.nn.Parameter:
    """A recorded (meta) tensor as a parameter with the same loader attributes."""
    if isinstance(template, torch.nn.Parameter):
        return template
    param = torch.nn.Parameter(template, requires_grad=False)
    param.__dict__.update(template.__dict__)
    return param


def _derived_parameters(module: torch.nn.Module) -> set[str]:
    """Parameters of `module` that `create_weights` did not make: vLLM records every created
    parameter for layerwise reload before loading (`restore_metadata`), except a few it
    never moves to the meta device (`bias`, routers' `e_score_correction_bias`), so one
    missing from the record was added by post-load processing. Empty where vLLM keeps no
    record (then nothing is known to be derived)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    except ImportError:
        return set()
    info = LAYERWISE_INFO.get(module)
    if info is None:
        return set()
    recorded = info.restore_metadata[0]
    return {
        name
        for name, _ in module.named_parameters(recurse=False)
        if name not in recorded and name not in SKIP_TENSORS
    }
