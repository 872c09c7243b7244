"""Model coverage on one GPU (vLLM 0.26): fast paths and the fail-safe path for the
frontier architectures, checked inside the real vLLM workers.

Three shaped models, bf16 unless said otherwise, random weights written as a checkpoint
(the zoo writer, `refitplane.models.zoo`, or `synthetic_weights` for the FP8 case), served by vLLM
from `load_format="dummy"` so that the refit is what puts the checkpoint in:

- `deepseek-v2-lite`: DeepSeek-V2-Lite's per-layer shapes (MLA with kv_lora_rank 512, 16
  heads, 64 routed + 2 shared experts of 1408, first layer dense), 3 layers;
- `nemotron-h`: Nemotron-3-Nano-shaped hybrid (Mamba2 with 8 groups, attention, a
  non-gated ReLU² MoE with a shared expert, an MLP), one layer of each kind;
- `qwen3-fp8-kv`: FP8 block-quantized linears plus per-layer KV-cache scales, served with
  an FP8 KV cache.

In every worker, `vllm_checks.receive_like_the_engine` binds exactly what the refitplane
engine binds (live fast-path parameters, whole-tensor fallback staging, or checkpoint
staging for FP8), fills it from the checkpoint, applies it as `finish_weight_update` does,
and compares every parameter and buffer, as the kernels read them, with vLLM's own
layerwise reload of the same checkpoint: they must be byte-identical. vLLM's reload is not
the oracle (it has bugs of its own, docs/models.md): `test_fresh_load_gpu.py` judges the
same cases against a fresh vLLM load, every kernel tensor, tokens and log-probs; this test
stays as the cheaper check that the receive path binds what vLLM's reload writes. Run after
`test_fresh_load_gpu.py` in the same pytest process, it judges what that file's "auto"
engine found (the same receive, its fresh-load check and one generation, then vLLM's
reload: `reload_differences`) and starts no engine; alone, it starts its own. The data
plane itself needs two GPUs (trainer and vLLM); `test_vllm_refit_gpu.py` covers it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.vllm_case import NEEDS_VLLM

pytestmark = [NEEDS_VLLM, pytest.mark.gpu(count=1)]

# The cases checked against vLLM's reload. test_fresh_load_gpu.py (same cases, and one more)
# runs this check in its "auto" engine, after one generation, when both files run in one
# pytest process (that file first): here it is then judged without an engine start.
COVERAGE_CASES = ["deepseek-v2-lite", "nemotron-h", "qwen3-fp8-kv"]

DEEPSEEK_V2_LITE = {
    "num_hidden_layers": 3,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
NEMOTRON_H = {
    "hybrid_override_pattern": "M*E-",
    "num_hidden_layers": 4,
    "hidden_size": 2688,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "chunk_size": 128,
    "intermediate_size": 1856,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def _checkpoint(case: str, root: Path, **config: Any) -> tuple[Path, dict[str, Any]]:
    """(checkpoint directory, extra `vllm.LLM` arguments) of a case; `config` overrides the
    zoo cases' shape (e.g. fewer routed experts, for a short GPU window)."""
    if case == "qwen3-fp8-kv":
        from refitplane.testing.synthetic_weights import write_checkpoint

        path = write_checkpoint(root, "qwen3-small", quant="fp8-kv")
        return path, {"kv_cache_dtype": "fp8"}
    if case == "qwen3-moe-fp8":
        # Block-FP8 attention (rewritten after loading: staged) beside block-FP8 experts
        # (Triton MoE: received in place), as Qwen3-30B-A3B-FP8, two layers; with KV-cache
        # scales, since the oracle's receiving engine starts from dummy weights and a scale no
        # checkpoint tensor loads keeps its dummy value (as under vLLM's own reload).
        from refitplane.testing.synthetic_weights import write_checkpoint

        return write_checkpoint(root, "qwen3-moe-fp8-tiny", quant="fp8-kv"), {
            "kv_cache_dtype": "fp8"
        }
    from refitplane.models.zoo.checkpoint import write_zoo_model

    arch, overrides = {
        "deepseek-v2-lite": ("deepseek_v2", DEEPSEEK_V2_LITE),
        "nemotron-h": ("nemotron_h", NEMOTRON_H),
    }[case]
    return write_zoo_model(root, arch, seed=3, dtype="bfloat16", **{**overrides, **config}), {}


@contextlib.contextmanager
def _vllm(
    model_dir: Path,
    *,
    load_format: str = "dummy",
    gpu_memory_utilization: float = 0.6,
    **kwargs: Any,
) -> Iterator[Any]:
    saved = dict(os.environ)
    os.environ.update(
        {
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_DEEP_GEMM_WARMUP": "skip",
            # This process may have touched CUDA already (pytest's GPU collection).
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        }
    )
    from vllm import LLM

    llm = LLM(
        model=str(model_dir),
        load_format=load_format,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        gpu_memory_utilization=gpu_memory_utilization,
        **kwargs,
    )
    try:
        yield llm
    finally:
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("case", COVERAGE_CASES)
def test_receive_path_equals_vllms_own_reload(
    case: str, tmp_path: Path, reload_reports: dict[str, dict[str, Any]]
) -> None:
    from tests.support.vllm_checks import receive_like_the_engine

    report = reload_reports.get(case)
    if report is None:  # test_fresh_load_gpu.py's "auto" engine did not run it here
        model_dir, extra = _checkpoint(case, tmp_path / case)
        with _vllm(model_dir, **extra) as llm:
            (report,) = llm.collective_rpc(receive_like_the_engine, args=(str(model_dir),))
        source = "an engine of its own"
    else:
        source = "test_fresh_load_gpu.py's auto engine"
    print(
        f"{case} ({source}): {report['mode']}, {report['summary']}; fallback: {report['fallback']}"
    )
    assert "error" not in report, report["error"]
    assert report["digests"] > 0
    if case == "qwen3-fp8-kv":
        # Where vLLM's reload and a fresh load disagree the fresh load is right: the receive
        # path re-folds the KV-cache scales from the float32 checkpoint scale as a fresh load
        # does (test_fresh_load_gpu.py: equal, 2026-11-26), and vLLM 0.26's layerwise reload
        # folds its own bf16-rounded copy (docs/models.md). So exactly the folded scales of
        # every attention layer differ from the reload, nothing else.
        layers = {n.rsplit(".self_attn", 1)[0] for n in report["differ"]}
        folded = {f"{layer}.self_attn.attn._{kv}_scale" for layer in layers for kv in "kv"}
        assert set(report["differ"]) == folded, report["differ"]
        assert len(layers) == 4, report["differ"]
    else:
        assert report["differ"] == [], report["differ"][:8]
    if case == "qwen3-fp8-kv":
        # FP8 linears (rewritten after loading) reload, a bucket of decoder layers at a
        # time, beside norms and embeddings received in place (the mixed binding, "auto" on
        # a GPU); the KV-cache scales come through the fallback path (vLLM's Attention
        # layer), and its post-load processing sets the cache scales.
        assert report["mode"] == "live"
        assert report["buckets"] > 1
        assert any("Attention" in reason for reason in report["fallback"]), report
    else:
        assert report["mode"] == "live"  # unquantized: straight into live parameters
    if case == "nemotron-h":
        # Mamba2's A is loaded as -exp(A_log): its mixer layer cannot be a box.
        assert report["fallback"], report
