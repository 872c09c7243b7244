"""End to end on GPUs: trainer ranks → vLLM 0.26 over nccl4py, through a real coordinator,
into live vLLM parameters. Trainer TP2 (GPUs 0-1) → vLLM TP2 or two TP1 replicas (GPUs 2-3),
and trainer TP1 (GPU 0) → vLLM TP1 (GPU 1) on two GPUs.

After the refit every vLLM parameter must hold exactly what `load_weights` writes from the
trainer's weights, and vLLM's greedy tokens must equal those of a transformers model built
from the same weights (float32 on both sides, so no bf16 near-ties)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refitplane.testing.model_layouts import GpuLayout
from tests.gpu.vllm_case import NEEDS_VLLM, NEW_TOKENS, PROMPT, SHAPE, layout_params, world_args

pytestmark = [NEEDS_VLLM]


def _reference_tokens() -> list[int]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from refitplane.models.tiny import hf_greedy_tokens
    from refitplane.testing.model_shapes import model_spec
    from refitplane.testing.synthetic_weights import synthetic

    spec = model_spec(SHAPE, "float32")
    model = Qwen3ForCausalLM(Qwen3Config(**spec.hf_config())).to("cuda:0", torch.float32)
    state = {
        ts.name: synthetic(ts.name, ts.shape, ts.dtype, "cuda:0") for ts in spec.tensor_specs()
    }
    model.load_state_dict(state, strict=not spec.tie_word_embeddings)
    model.eval()
    return hf_greedy_tokens(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("layout", layout_params("tp1", "tp2", "2xtp1"))
def test_refit_into_live_vllm_is_exact(layout: GpuLayout, tmp_path: Path) -> None:
    from refitplane.testing.refit_world import refit_world
    from tests.support.refit_checks import check_synthetic_weights

    with refit_world(
        shape=SHAPE, device="cuda", dtype="float32", workdir=tmp_path, **world_args(layout)
    ) as world:
        before = world.ask("replica-0", ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
        first = world.refit()
        assert first.state == "COMMITTED", first
        assert first.tensors_verified == first.tensors_total > 0
        again = world.refit()  # the group and plan are reused
        assert again.state == "COMMITTED", again
        assert again.version == first.version + 1
        served = {}
        for replica in world.replicas():
            for report in world.ask(
                replica, ("rpc", (check_synthetic_weights, [SHAPE, "float32"])), "rpc"
            ):
                assert report["error"] == ""
                assert report["mode"] == "live"  # unquantized on GPUs: straight into parameters
                assert report["failures"] == [], report["failures"][:5]
            served[replica] = world.ask(replica, ("tokens", (PROMPT, NEW_TOKENS)), "tokens")
    expected = _reference_tokens()
    for replica, tokens in served.items():
        assert tokens == expected, (replica, tokens, expected)
    assert expected != before  # dummy weights before, the trainer's after
