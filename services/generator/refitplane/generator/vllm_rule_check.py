"""Fast-path rules prove themselves at engine start, against vLLM's own `load_weights`.

A rule (`vllm_layer_rules`) restates what a layer class's `weight_loader` does with a
checkpoint tensor. The model's `load_weights` may transform tensors before any loader sees
them (Llama 4 permutes q/k rows for its rotary layout), and a rule that matched the layer
class would then describe the wrong bytes: every checksum passes (they compare what was sent
with what arrived), the served model is wrong. So before the engine trusts a rule for a
model, it asks the model:

- for each layer class a rule claims, one layer per role (module path with layer numbers
  folded: `self_attn.o_proj` and `mlp.down_proj` are checked apart), the checkpoint tensors
  its rule reads are fed to the model's own `load_weights` *coordinate-coded*: in run `d`,
  every element holds `tensor_id * K + 1 + its index along dimension d`, an integer;
- the parameters that load reaches (found first by tracing it on meta tensors,
  `vllm_load_trace`, so nothing live is ever written) are swapped for integer shadows in
  loader format (`-1` = not written), on the CPU;
- after one run per dimension every shadow element names the checkpoint tensor and the full
  coordinate it came from; that is compared, element by element, with where the rule's
  placements say each element lands (padding may be left alone or zeroed, as the loaders
  do). Integers survive whatever dtype the live parameter has (bf16, FP8); a loader that
  does arithmetic on values (a negation, an exp) shows up as a mismatch too.

A mismatch, or a loader that refuses the coded input, moves that layer class to the
fallback path (vLLM's own loader on whole tensors): slower, never wrong. Cost at start: one
layer per role, a few `load_weights` calls on it, memory for its shadows and inputs
(`RuleCheckPolicy.max_bytes` bounds it; a role above the bound is not guessed at: its class
falls back). Classes a test pins (`PINNED_RULES`) may be skipped by name.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

from refitplane.errors import LayoutError
from refitplane.generator.vllm_layout import ParamLayout, RuleCheck, RuleStatus
from refitplane.reshard.boxes import box_shape, format_box
from refitplane.reshard.layout import TensorSpec

if TYPE_CHECKING:
    from refitplane.generator.vllm_rule_parts import DescribedParam

log = logging.getLogger("refitplane.generator.rule_check")

# Layer classes whose rule a test pins: the in-worker layout check (every fast-path view
# against what `load_weights` writes from a real checkpoint) over the model matrix and the
# layout cases. Only these may skip the start-up check (`REFIT_RULE_CHECK_SKIP`), and only
# where the operator accepts that the model at hand is like the ones tested.
PINNED_RULES: Final[Mapping[str, str]] = {
    "QKVParallelLinear": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "MergedColumnParallelLinear": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "RowParallelLinear": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "VocabParallelEmbedding": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "ParallelLMHead": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "RMSNorm": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "RoutedExperts": "tests/integration/generator/test_vllm_layouts_cpu.py",
    "ColumnParallelLinear": "tests/integration/generator/test_model_matrix.py",
    "ReplicatedLinear": "tests/integration/generator/test_model_matrix.py",
    "GateLinear": "tests/integration/generator/test_model_matrix.py",
}

# Host memory one role's check may use (shadows plus coded inputs) unless told otherwise.
DEFAULT_MAX_BYTES: Final = 16 << 30


@dataclass(frozen=True, slots=True)
class RuleCheckPolicy:
    """Whether and how rules are checked at start. `skip`: pinned classes not checked."""

    enabled: bool = True
    skip: frozenset[str] = frozenset()
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        unpinned = sorted(self.skip - set(PINNED_RULES))
        if unpinned:
            raise LayoutError(
                f"rule check skipped for {unpinned}, which no test pins; only "
                f"{sorted(PINNED_RULES)} may skip the start-up check",
                field="REFIT_RULE_CHECK_SKIP",
            )


@dataclass
class _ClassResult:
    samples: list[str] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0
    elements: int = 0
    peak_bytes: int = 0


def role_of(path: str) -> str:
    """A module path with its layer numbers folded: `model.layers.3.mlp` → `model.layers.N.mlp`."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "N", path)


def reject_unproven(
    model: torch.nn.Module,
    fast: dict[str, list[DescribedParam]],
    rejected: dict[str, str],
    policy: RuleCheckPolicy | None,
    *,
    vllm_config: Any = None,
) -> tuple[RuleCheck, ...]:
    """Check the rules of the fast-path layers (`fast`, module path → described
    parameters); every layer of a class whose check fails moves from `fast` to `rejected`
    with the reason. Returns what the check found per class."""
    checks = check_rules(
        model, fast, policy if policy is not None else RuleCheckPolicy(), vllm_config=vllm_config
    )
    for check in checks:
        if check.status != "mismatch":
            continue
        for path in [p for p in fast if type(model.get_submodule(p)).__name__ == check.layer_class]:
            rejected[path] = (
                f"its {check.layer_class} rule failed the start-up check: {check.reason}"
            )
            del fast[path]
    return tuple(checks)


def check_rules(
    model: torch.nn.Module,
    fast: Mapping[str, Sequence[DescribedParam]],
    policy: RuleCheckPolicy,
    *,
    vllm_config: Any = None,
) -> list[RuleCheck]:
    """Check the rule of every layer class in `fast` (module path → its described
    parameters) on one layer per role; one `RuleCheck` per class."""
    if not policy.enabled:
        return []
    all_params = {d.param.name: d.param for described in fast.values() for d in described}
    roles: dict[str, dict[str, str]] = {}
    for path in fast:
        cls = type(model.get_submodule(path)).__name__
        roles.setdefault(cls, {}).setdefault(role_of(path), path)
    out: list[RuleCheck] = []
    for cls, samples in sorted(roles.items()):
        if cls in policy.skip:
            out.append(RuleCheck(cls, "skipped", reason=f"pinned by {PINNED_RULES[cls]}"))
            continue
        result = _ClassResult()
        for path in samples.values():
            start = time.perf_counter()
            try:
                problem, elements, needed = _check_layer(
                    model, path, fast[path], all_params, policy.max_bytes, vllm_config
                )
            except Exception as exc:
                log.debug("rule check of %s failed", path, exc_info=True)
                problem, elements, needed = (
                    f"vLLM's load_weights failed on coordinate-coded input for {path!r} "
                    f"({type(exc).__name__}: {exc})",
                    0,
                    0,
                )
            result.seconds += time.perf_counter() - start
            result.samples.append(path)
            result.elements += elements
            result.peak_bytes = max(result.peak_bytes, needed)
            if problem:
                result.reason = problem
                break
        status: RuleStatus = "mismatch" if result.reason else "verified"
        out.append(
            RuleCheck(
                cls,
                status,
                tuple(result.samples),
                result.reason,
                result.seconds,
                result.elements,
                result.peak_bytes,
            )
        )
    return out


def _check_layer(
    model: torch.nn.Module,
    path: str,
    described: Sequence[DescribedParam],
    all_params: Mapping[str, ParamLayout],
    max_bytes: int,
    vllm_config: Any,
) -> tuple[str, int, int]:
    """(problem or "", elements compared, bytes needed) for one layer."""
    from refitplane.generator.vllm_load_trace import trace_load_targets

    specs: dict[str, TensorSpec] = {s.name: s for d in described for s in d.specs}
    order = sorted(specs)
    targets = trace_load_targets(model, specs, vllm_config=vllm_config)
    missing = [name for name in order if not targets.get(name)]
    if missing:
        return f"vLLM's load_weights loads {missing[0]!r} into no parameter", 0, 0
    reached = sorted({p for params in targets.values() for p in params})
    named = dict(model.named_parameters())
    templates = {name: _shadow_template(model, name, named.get(name)) for name in reached}
    widest = max(max((int(n) for n in specs[name].shape), default=1) for name in order)
    stride = widest + 1
    dtype = torch.int32 if len(order) * stride + stride < 2**31 - 1 else torch.int64
    item = torch.empty((), dtype=dtype).element_size()
    needed = item * (
        sum(t.numel() for t in templates.values()) + sum(specs[n].numel for n in order)
    )
    if needed > max_bytes:
        return (
            f"checking {path!r} needs {needed} bytes of host memory, above the "
            f"{max_bytes}-byte bound (REFIT_RULE_CHECK_MAX_BYTES)",
            0,
            needed,
        )
    ids = {name: i for i, name in enumerate(order)}
    runs = max(max(len(specs[n].shape) for n in order), 1)
    compared = 0
    for dim in range(runs):
        shadows = _load_coded(model, templates, specs, order, stride, dim, dtype, vllm_config)
        for name in reached:
            layout = all_params.get(name)
            if layout is None:
                continue  # not a fast-path parameter: the fallback plan decides about it
            got = shadows[name].data
            if tuple(got.shape) != layout.shape:
                return (
                    f"{name} is {list(got.shape)} in vLLM's loader format, the rule says "
                    f"{list(layout.shape)}",
                    compared,
                    needed,
                )
            problem = _compare(layout, got, ids, stride, dim, order)
            if problem:
                return problem, compared, needed
            compared += got.numel()
    return "", compared, needed


def _load_coded(
    model: torch.nn.Module,
    templates: Mapping[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    order: Sequence[str],
    stride: int,
    dim: int,
    dtype: torch.dtype,
    vllm_config: Any,
) -> dict[str, torch.nn.Parameter]:
    """Fresh shadows after `load_weights` of the tensors coded for run `dim`. The coded
    tensors are first handed over as broadcast views (no memory: loaders narrow them to
    this rank's shard and copy that); a loader that cannot take a view (it reshapes in a
    way strides do not allow) gets them materialized."""
    ids = {name: i for i, name in enumerate(order)}
    for materialize in (False, True):
        shadows = {name: _shadow(t, dtype) for name, t in templates.items()}
        weights = [(n, _coded(specs[n], ids[n], stride, dim, dtype, materialize)) for n in order]
        try:
            load_into(model, shadows, weights, vllm_config)
        except Exception:
            if materialize:
                raise
            log.debug("load_weights refused broadcast views; materializing", exc_info=True)
            continue
        return shadows
    raise AssertionError("unreachable")


def _coded(
    spec: TensorSpec,
    tensor_id: int,
    stride: int,
    dim: int,
    dtype: torch.dtype,
    materialize: bool = True,
) -> torch.Tensor:
    """The checkpoint tensor `spec` with every element `tensor_id * stride + 1 + its index
    along `dim`` (1 + 0 for a dimension the tensor does not have)."""
    shape = tuple(int(n) for n in spec.shape)
    base = tensor_id * stride + 1
    if dim >= len(shape):
        constant = torch.full([1] * len(shape), base, dtype=dtype).expand(shape)
        return constant.contiguous() if materialize else constant
    view = [1] * len(shape)
    view[dim] = shape[dim]
    coords = torch.arange(base, base + shape[dim], dtype=dtype).view(view).expand(shape)
    return coords.contiguous() if materialize else coords


def _expected_region(
    hf_box: Sequence[tuple[int, int]], base: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    shape = box_shape(tuple(hf_box))
    if dim >= len(shape):
        return torch.full(shape, base, dtype=dtype)
    start, stop = hf_box[dim]
    view = [1] * len(shape)
    view[dim] = stop - start
    return torch.arange(base + start, base + stop, dtype=dtype).view(view).expand(shape)


def _compare(
    layout: ParamLayout,
    got: torch.Tensor,
    ids: Mapping[str, int],
    stride: int,
    dim: int,
    order: Sequence[str],
) -> str:
    """Where `got` (a shadow after run `dim`) differs from the rule's placements, or "".
    Consumes `got`: each checked region is blanked once compared, so one pass over what is
    left finds anything written where the rule says nothing (padding may be zeroed)."""
    for p in layout.placements:
        if p.hf_name not in ids:
            continue  # another layer's tensor (not fed in this check)
        region = p.view(got)
        want = _expected_region(p.hf_box, ids[p.hf_name] * stride + 1, dim, got.dtype)
        if not torch.equal(region, want):
            bad = (region != want).nonzero()[0]
            return _mismatch(layout.name, p, bad, region, want, stride, dim, order)
        region.fill_(-1)
    written = (got > 0).nonzero()
    if written.numel():
        index = tuple(int(i) for i in written[0])
        where = f"{layout.name}{format_box(tuple((i, i + 1) for i in index))}"
        return (
            f"vLLM's load_weights writes {_decode(int(got[index]), stride, dim, order)} at "
            f"{where}, the rule says nothing"
        )
    return ""


def _mismatch(
    param: str,
    placement: Any,
    bad: torch.Tensor,
    region: torch.Tensor,
    want: torch.Tensor,
    stride: int,
    dim: int,
    order: Sequence[str],
) -> str:
    """The first differing element of a placement's region, named in the parameter."""
    local = tuple(int(i) for i in bad)
    offsets = iter(local)
    index = tuple(
        start if d in placement.squeeze else start + next(offsets)
        for d, (start, _) in enumerate(placement.param_box)
    )
    where = f"{param}{format_box(tuple((i, i + 1) for i in index))}"
    return (
        f"vLLM's load_weights writes {_decode(int(region[local]), stride, dim, order)} at "
        f"{where}, the rule says {_decode(int(want[local]), stride, dim, order)}"
    )


def _decode(value: int, stride: int, dim: int, order: Sequence[str]) -> str:
    if value <= 0:
        return "nothing"
    tensor_id, coord = divmod(value - 1, stride)
    name = order[tensor_id] if tensor_id < len(order) else f"tensor #{tensor_id}"
    return f"{name} index {coord} along dimension {dim}"


def _shadow_template(model: torch.nn.Module, name: str, live: torch.Tensor | None) -> torch.Tensor:
    path, _, pname = name.rpartition(".")
    template = loader_format_param(model.get_submodule(path), pname, live)
    if template is None:
        raise LayoutError("no loader-format record of this parameter", tensor=name)
    return template


def loader_format_param(
    owner: torch.nn.Module, pname: str, live: torch.Tensor | None
) -> torch.Tensor | None:
    """A tensor whose class and attributes (`weight_loader`, `output_dim`, ...) and shape
    are the ones parameter `pname` of `owner` had when `create_weights` made it: vLLM
    records them for layerwise reload (post-load processing may replace the parameter);
    the live parameter where nothing was recorded. After a layerwise reload the recorded
    loader is still wrapped by vLLM's `online_process_loader`, which would process the layer
    and copy into the live kernel tensors: the loader underneath is used, so a load into a
    copy made from this never touches the live model."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:  # vLLM without layerwise reload: the live parameter is the template
        return live
    info = LAYERWISE_INFO.get(owner)
    recorded = info.restore_metadata[0].get(pname) if info is not None else None
    if recorded is None:
        return live
    template = torch.empty(tuple(recorded.shape), device="meta", dtype=recorded.dtype)
    template.__class__ = recorded.__class__
    template.__dict__.update(recorded.__dict__)
    restored: torch.Tensor = restore_layer_refs(template, owner)
    loader = getattr(restored, "weight_loader", None)
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if loader is not None:
        restored.weight_loader = loader  # type: ignore[attr-defined]
    return restored


def _shadow(template: torch.Tensor, dtype: torch.dtype) -> torch.nn.Parameter:
    """An integer parameter of the template's loader-format shape, class and attributes,
    every element -1 (not written)."""
    data = torch.full(tuple(template.shape), -1, dtype=dtype)
    shadow = torch.nn.Parameter(data, requires_grad=False)
    if isinstance(template, torch.nn.Parameter):  # vLLM's parameter classes load themselves
        shadow.__class__ = type(template)
    shadow.__dict__.update(template.__dict__)
    return shadow


def load_into(
    model: torch.nn.Module,
    shadows: Mapping[str, torch.nn.Parameter],
    weights: Iterable[tuple[str, torch.Tensor]],
    vllm_config: Any = None,
) -> None:
    """Run `model.load_weights(weights)` with the named parameters (`named_parameters`
    names) swapped for `shadows` wherever they are registered (a tied parameter in every
    module holding it); the live ones are always put back."""
    from refitplane.generator.vllm_load_trace import current_config

    named = dict(model.named_parameters(remove_duplicate=False))
    by_id = {id(named[name]): shadow for name, shadow in shadows.items() if name in named}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in model.modules():
            for pname, current in list(module._parameters.items()):
                if current is not None and id(current) in by_id:
                    module._parameters[pname] = by_id[id(current)]
                    swapped.append((module, pname, current))
        with current_config(vllm_config):
            model.load_weights(weights)  # type: ignore[operator]
    finally:
        for module, pname, current in swapped:
            module._parameters[pname] = current
