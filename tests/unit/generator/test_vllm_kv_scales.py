"""A refit folds FP8 attention's KV-cache scales as a fresh load does (`vllm_kv_scales`),
through vLLM's own KV-cache quant method, whatever the layer held before: in a bf16 model
the received float32 scale is rounded to bf16 first, as the model's own scale parameter
rounds it on a start (the values a fresh load of a Qwen3 FP8 checkpoint held on an H100,
vLLM 0.26, 2026-11-26: 0.06578174 → 0.06591797, 0.07717846 → 0.07714844)."""

from __future__ import annotations

import types

import pytest
import torch

from refitplane.generator.vllm_kv_scales import attention_scale_sources, fold_attention_scales
from refitplane.generator.vllm_layout import FallbackParam

pytest.importorskip("vllm")


class _Attention(torch.nn.Module):
    """The state vLLM's `Attention` keeps for an FP8 KV cache (scales folded at load)."""

    def __init__(self) -> None:
        from vllm.model_executor.layers.attention.attention import set_default_quant_scales
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        super().__init__()
        set_default_quant_scales(self, register_buffer=True)
        self.kv_cache_dtype = "fp8"
        self.calculate_kv_scales = False
        self.quant_method = BaseKVCacheMethod(quant_config=None)
        self.processed = 0

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self.processed += 1


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].attn = _Attention()
    model.layers[0].proj = torch.nn.Linear(2, 2)
    return model


def _layout() -> object:
    def fallback(name: str, source: str) -> FallbackParam:
        return FallbackParam(name, (), "float32", "not understood", (source,))

    params = [
        fallback("layers.0.attn.k_scale", "layers.0.k_proj.k_scale"),
        fallback("layers.0.attn.v_scale", "layers.0.v_proj.v_scale"),
        fallback("layers.0.proj.weight", "layers.0.proj.weight"),  # not a KV-cache scale
    ]
    return types.SimpleNamespace(fallback={p.name: p for p in params})


def test_received_scales_are_folded_where_the_kernels_read_them() -> None:
    from vllm.config import VllmConfig

    model = _model()
    attn = model.layers[0].attn
    sources = attention_scale_sources(model, _layout())  # type: ignore[arg-type]
    assert sources == {
        "layers.0.k_proj.k_scale": ("layers.0.attn", "k_scale"),
        "layers.0.v_proj.v_scale": ("layers.0.attn", "v_scale"),
    }
    attn._k_scale.fill_(0.5)  # what a dummy start (or a stale reload) left
    attn._v_scale.fill_(0.5)
    kernel_k = attn._k_scale
    received = {
        "layers.0.k_proj.k_scale": torch.tensor(0.06578174233436584),
        "layers.0.v_proj.v_scale": torch.tensor(0.077178455889225),
        "layers.0.proj.weight": torch.zeros(2, 2),
    }
    config = VllmConfig()  # a real config to process under; the layer reads only its dtype
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.bfloat16))
    assert fold_attention_scales(model, config, sources, received) == 1
    assert attn._k_scale is kernel_k  # written in place: kernels and CUDA graphs keep it
    # What the fresh load held on the GPU: the checkpoint's scales rounded to bf16.
    assert (float(attn._k_scale), float(attn._v_scale)) == (0.06591796875, 0.0771484375)
    assert (float(attn._k_scale_cpu), float(attn._v_scale_cpu)) == (0.06591796875, 0.0771484375)
    assert torch.get_default_dtype() == torch.float32
    assert not hasattr(attn, "k_scale")  # the loader-format parameters are gone again
    assert attn.processed == 1
