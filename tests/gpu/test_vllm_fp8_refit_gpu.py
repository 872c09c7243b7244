"""FP8 with block scales, end to end on GPUs: trainer ranks (TP2 on GPUs 0-1, or TP1 on GPU
0) hold float8_e4m3fn linear weights and their float32 128x128 block scales → vLLM 0.26
(TP2 on GPUs 2-3, or TP1 on GPU 1) serving an FP8-serialized checkpoint layout
(`quantization_config` with `weight_block_size`), started with dummy weights.

FP8 layers are received into checkpoint-format staging and loaded through vLLM's layerwise
reload, which re-runs the FP8 kernels' post-load processing. The proof that the processing
is right: after the refit, every parameter and buffer of vLLM, as the kernels read it, is
byte-identical to a vLLM that loaded a checkpoint of the same weights from disk, and both
produce the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from refitplane.testing.model_layouts import GpuLayout
from tests.gpu.vllm_case import NEEDS_VLLM, NEW_TOKENS, PROMPT, SHAPE, layout_params, world_args

pytestmark = [NEEDS_VLLM]

# KV-cache quantization scales: not in the checkpoint (so no refit sends them); vLLM keeps
# whatever its first load left there, and reads them only with an FP8 KV cache.
KV_SCALES = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale")


@pytest.mark.parametrize("layout", layout_params("tp1", "tp2"))
def test_fp8_block_refit_equals_a_checkpoint_load(layout: GpuLayout, tmp_path: Path) -> None:
    from refitplane.testing.refit_world import refit_world
    from refitplane.testing.synthetic_weights import write_checkpoint
    from tests.support.refit_checks import parameter_digests

    args = {"shape": SHAPE, "device": "cuda", "quant": "fp8", **world_args(layout)}
    with refit_world(workdir=tmp_path / "refit", **args) as world:
        before = world.ask("replica-0", ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
        for _ in range(2):  # the second refit reuses the group, plan and staging
            result = world.refit()
            assert result.state == "COMMITTED", result
            assert result.tensors_verified == result.tensors_total > 0
        refit_tokens = world.ask("replica-0", ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
        refit_digests = world.ask("replica-0", ("rpc", (parameter_digests, [])), "rpc")

    checkpoint = write_checkpoint(tmp_path / "checkpoint", SHAPE, quant="fp8")
    with refit_world(
        workdir=tmp_path / "reference", load_format="auto", model_dir=checkpoint, **args
    ) as reference:
        loaded_tokens = reference.ask("replica-0", ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
        loaded_digests = reference.ask("replica-0", ("rpc", (parameter_digests, [])), "rpc")

    # one per TP worker
    assert len(refit_digests) == len(loaded_digests) == layout.replica_tps[0]
    for worker, (got, want) in enumerate(zip(refit_digests, loaded_digests, strict=True)):
        assert got.keys() == want.keys()
        differ = sorted(n for n in want if got[n] != want[n] and not n.endswith(KV_SCALES))
        assert differ == [], (worker, differ[:5])
        assert any(d.startswith("float8_e4m3fn ") for d in got.values())  # FP8 kernels
    assert refit_tokens == loaded_tokens
    assert refit_tokens != before  # dummy weights before, the trainer's after
