"""The synthetic FP8 checkpoints declare what they keep unquantized as a real one does: vLLM
gives the quantization config to every linear, MoE routers included, so a config that does
not name the routers makes vLLM create float8 routers that the checkpoint's bf16 tensors
cannot load into (on 2 H100s, 2026-11-26, the Qwen3-30B-A3B FP8 row failed vLLM's start
there). Judged by vLLM's own Fp8Config, as vLLM reads config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refitplane.testing.model_shapes import tensor_specs, write_config


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3-small"])
def test_fp8_checkpoints_keep_exactly_their_unquantized_linears_out(
    tmp_path: Path, shape: str
) -> None:
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8")
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    config = json.loads((write_config(tmp_path, shape, quant="fp8") / "config.json").read_text())
    ignored = fp8.Fp8Config.from_config(config["quantization_config"]).ignored_layers
    specs = tensor_specs(shape, quant="fp8")
    quantized = {ts.name.removesuffix(".weight") for ts in specs if ts.dtype == "float8_e4m3fn"}
    routers = {
        ts.name.removesuffix(".weight") for ts in specs if ts.name.endswith(".mlp.gate.weight")
    }
    assert bool(routers) == (shape == "qwen3-30b-a3b")
    for module in routers | {"lm_head"}:
        assert is_layer_skipped(module, ignored), module
    for module in quantized:
        assert not is_layer_skipped(module, ignored), module
