"""The fresh-load oracle on one GPU (vLLM 0.26): a refit's receive path leaves the replica
equal to a fresh vLLM load of the same checkpoint.

For the shaped models of `test_model_coverage_gpu.py` (DeepSeek-V2-Lite shape,
Nemotron-3-Nano-shaped hybrid, Qwen3 FP8 block-quantized with KV-cache scales; bf16), a
checkpoint is written, then:

1. a fresh `LLM` loads it (`load_format="auto"`): every kernel tensor of every module
   (parameters, buffers, tensor attributes of modules and their helper objects:
   `tests.support.fresh_load.kernel_tensors`) and the greedy tokens with top-5 log-probs
   are kept, and the engine stops;
2. a second `LLM` starts from dummy weights; in its worker the engine's receive path
   (`vllm_checks.receive_checkpoint`: live fast path + fallback, or everything staged and
   applied at finish) fills it from the checkpoint;
3. every kernel tensor equals the fresh load's, byte for byte, and the served tokens and
   log-probs are the fresh load's (up to its first near-tie).

The data plane itself needs two GPUs (trainer and vLLM): `test_vllm_refit_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.test_model_coverage_gpu import _checkpoint, _vllm
from tests.gpu.vllm_case import NEEDS_VLLM, NEW_TOKENS, PROMPT

pytestmark = [NEEDS_VLLM, pytest.mark.gpu(count=1)]


@pytest.mark.parametrize("mode", ["auto", "live", "staged"])
@pytest.mark.parametrize(
    "case", ["nemotron-h", "deepseek-v2-lite", "qwen3-fp8-kv", "qwen3-moe-fp8"]
)
def test_receive_path_equals_a_fresh_load(case: str, mode: str, tmp_path: Path) -> None:
    from tests.support.fresh_load import (
        differences_from_fresh,
        kernel_tensors,
        served_output,
        snapshot_fresh,
    )
    from tests.support.vllm_checks import receive_checkpoint

    model_dir, extra = _checkpoint(case, tmp_path / case)
    with _vllm(model_dir, load_format="auto", **extra) as llm:
        fresh = snapshot_fresh(llm, model_dir, PROMPT, NEW_TOKENS)
    with _vllm(model_dir, **extra) as llm:  # dummy weights: the receive puts the checkpoint in
        (report,) = llm.collective_rpc(receive_checkpoint, args=(str(model_dir), mode))
        output = served_output(llm, PROMPT, NEW_TOKENS)
        tensors = llm.collective_rpc(kernel_tensors)
    print(f"{case} ({mode}): {report['mode']}, {report['summary']}")
    failures = differences_from_fresh(fresh, tensors, output)
    for failure in failures:  # all of them, as found: a job cut short still shows them
        print(f"{case} ({mode}): {failure}", flush=True)
    assert failures == [], failures[:10]
    if mode == "staged":
        assert report["mode"] == "staged"
