"""The refit world's teacher-forced comparison (`benchmarks/ipc_refit.py --tokens`): vLLM's
prompt logprobs read as "the most likely next token after each prefix", aligned with a
causal LM's logits (position i predicts token i + 1), on vLLM's own output types."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("vllm")


def test_prompt_logprobs_give_the_next_token_after_each_prefix() -> None:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from refitplane.testing.refit_world.replica import _top1

    def position(actual: int, best: int) -> dict[int, Logprob]:
        # vLLM lists the prompt's own token (any rank) and the top-1 (rank 1).
        return {actual: Logprob(-2.0, 3, None), best: Logprob(-0.1, 1, None)}

    prompt = [5, 6, 7, 8]
    output = RequestOutput(
        request_id="0",
        prompt=None,
        prompt_token_ids=prompt,
        # Position 0 has no logprobs; position i scores token i given tokens < i.
        prompt_logprobs=[None, position(6, 60), position(7, 7), position(8, 80)],
        outputs=[CompletionOutput(0, "", [90], None, None)],
        finished=True,
    )
    # After [5] → 60, after [5, 6] → 7, after [5, 6, 7] → 80, after the whole prompt → 90.
    assert _top1(output) == [60, 7, 80, 90]
