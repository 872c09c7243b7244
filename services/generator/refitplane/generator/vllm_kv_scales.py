"""FP8 attention's KV-cache scales after a refit: folded into the cache scales exactly as a
fresh load folds them.

A quantized attention layer (`quant_method` a vLLM `BaseKVCacheMethod`) creates `k_scale` /
`v_scale` / `q_scale` / `prob_scale` parameters, loads whichever the checkpoint has, and its
post-load processing folds them into the scales the kernels read (`_k_scale`, `_v_scale`,
`_q_scale`, `_prob_scale`, their host copies `_k_scale_cpu` / `_v_scale_cpu` and floats),
then deletes the parameters. A start builds the model under the model's dtype, so in a bf16
model those parameters are bf16 and the checkpoint's float32 `k_scale` is rounded by its
loader before it is folded (0.06578174 → 0.06591797). A refit receives the checkpoint's
scales through the fallback path (`vllm_layout._with_vanished`), and vLLM 0.26's layerwise
reload re-creates the parameters (`_reload_attention_scales`) in float32, so it folds the
value unrounded: on one H100 (2026-11-26, windows WA and WC, `tests/gpu/fresh_load_probe.py
qwen3-fp8-kv`) every `_k_scale` / `_v_scale` and host copy differed from a fresh load of the
same checkpoint in exactly that rounding, and the served tokens differed from the first one.
So after a bucket is reloaded, every attention layer it carried scales for is folded again
here the way a start does it: fresh sentinel parameters (`create_weights`: "not in the
checkpoint") created in the model's dtype, the received scales through their loaders
(rounding them to it), the quant method's processing, then the layer's own. The processing
writes the kernel-side scales in place (CUDA graphs keep their addresses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from refitplane.generator.vllm_layout import VllmLayout

# The scale parameters a KV-cache quant method creates on an attention layer.
KV_SCALE_PARAMS = ("k_scale", "v_scale", "q_scale", "prob_scale")


def attention_scale_sources(
    model: torch.nn.Module, layout: VllmLayout
) -> dict[str, tuple[str, str]]:
    """Checkpoint tensor → (attention layer path, scale parameter) for every fallback
    parameter that is a KV-cache scale of a layer whose quant method folds them. Empty where
    vLLM has no such method or the model has no quantized KV cache."""
    try:
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    except ImportError:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for param in layout.fallback.values():
        path, _, short = param.name.rpartition(".")
        if short not in KV_SCALE_PARAMS or len(param.sources) != 1:
            continue
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(getattr(layer, "quant_method", None), BaseKVCacheMethod):
            out[param.sources[0]] = (path, short)
    return out


def fold_attention_scales(
    model: torch.nn.Module,
    vllm_config: Any,
    sources: Mapping[str, tuple[str, str]],
    tensors: Mapping[str, torch.Tensor],
) -> int:
    """Fold the KV-cache scales among `tensors` (checkpoint name → received tensor; `sources`
    from `attention_scale_sources`) into their attention layers as a fresh load does.
    Returns how many layers were folded."""
    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        target = sources.get(name)
        if target is not None:
            by_layer.setdefault(target[0], {})[target[1]] = tensor
    if not by_layer:
        return 0
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    model_dtype = vllm_config.model_config.dtype
    with set_current_vllm_config(vllm_config):
        for path, received in by_layer.items():
            layer: Any = model.get_submodule(path)  # a vLLM attention layer
            method = layer.quant_method
            # Every scale back at "not in the checkpoint", created in the model's dtype as
            # on a start (vLLM builds the model under it): the received float32 scale is
            # rounded to that dtype by its loader before it is folded, as on a fresh load.
            with _default_dtype(model_dtype):
                method.create_weights(layer)
            for short, value in received.items():
                param = getattr(layer, short)
                getattr(param, "weight_loader", default_weight_loader)(param, value)
            method.process_weights_after_loading(layer)
            layer.process_weights_after_loading(vllm_config.model_config.dtype)
    return len(by_layer)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
