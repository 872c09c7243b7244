"""A prompt an offline engine served before a refit is served from the new weights after it,
through either door an offline RL loop uses.

vLLM keeps the keys and values of every full block of a served prompt (prefix caching, on
by default) and reuses them for any later prompt that starts the same way — a shared system
prompt, in RL rollouts. They were computed with the weights a refit replaces: a server's
/pause clears them, but an offline `LLM` is never paused. So the sidecar's
`OfflineLLMControl` clears the cache at the refit's pause, and the API guard clears it when
vLLM's own `finish_weight_update` applied an update on an offline `LLM`. Here a vllm-cpu
engine serves a prompt of three 32-token blocks from checkpoint A, refits to B — through
the coordinator and the sidecar, then (another engine) through vLLM's own trainer API with
the refitplane backend — and must then serve that prompt exactly as a fresh load of B does
(tokens, top-5 log-probs, kernel tensors); without the clearing, the cached blocks of A make
it serve something else.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.generator.vllm_refits import RefitSession
from tests.integration.vllm_marks import VLLM_CPU

pytestmark = VLLM_CPU

# Three full 32-token blocks and a tail: vLLM caches the full blocks.
PROMPT = [(7 * i) % 300 + 3 for i in range(100)]
NEW_TOKENS = 6
DTYPE = "bfloat16"
ENGINE = {"dtype": DTYPE, "block_size": 32, "enable_prefix_caching": True}


@dataclass(frozen=True)
class Checkpoints:
    served: Path  # A: what the engine starts from and serves before the refit
    trainer: Path  # B: what the trainer holds
    fresh: Any  # tests.support.fresh_load.FreshLoad of B


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    from refitplane.models.tiny import confident_seed
    from tests.support.fresh_load import fresh_load

    root = tmp_path_factory.mktemp("prefix-cache")
    seeds = {"prompt_token_ids": PROMPT, "max_new_tokens": NEW_TOKENS}
    _, served = confident_seed(root / "a", "qwen3", start=300, **seeds)
    _, trainer = confident_seed(root / "b", "qwen3", start=400, **seeds)
    return Checkpoints(
        served, trainer, fresh_load(trainer, prompt=PROMPT, new_tokens=NEW_TOKENS, **ENGINE)
    )


@pytest.fixture
def served_a(checkpoints: Checkpoints) -> Iterator[tuple[Any, list[int]]]:
    """An engine on A (the refitplane backend) that has served the prompt once: its full
    blocks are in the prefix cache. Yields the engine and the tokens A served."""
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.fresh_load import served_output

    with vllm_cpu_engine(
        checkpoints.served, weight_transfer_config={"backend": "refitplane"}, **ENGINE
    ) as llm:
        before = served_output(llm, PROMPT, NEW_TOKENS)
        # The test can fail: the two checkpoints serve this prompt differently.
        assert before.tokens != checkpoints.fresh.output.tokens
        yield llm, before.tokens


def test_the_sidecar_door_serves_the_new_weights_for_a_cached_prompt(
    checkpoints: Checkpoints, served_a: tuple[Any, list[int]]
) -> None:
    from tests.support.fresh_load import differences_from_fresh

    llm, _ = served_a
    session = RefitSession(llm, prompt=PROMPT, new_tokens=NEW_TOKENS, generates=True)
    try:
        refit = session.refit_checkpoint(checkpoints.trainer, "tp", 1)
    finally:
        session.close()
    assert refit.state == "COMMITTED", refit.message
    failures = differences_from_fresh(checkpoints.fresh, refit.kernel_tensors, refit.output)
    assert failures == [], failures[:5]


def test_vllms_own_trainer_api_serves_the_new_weights_for_a_cached_prompt(
    checkpoints: Checkpoints, served_a: tuple[Any, list[int]]
) -> None:
    """`WeightTransferTrainerFactory.trainer_init(RefitplaneTrainerInitInfo(...),
    client=<the offline LLM>, source=ModuleSource(model))` then `send_weights()`: vLLM's
    verbs reach the engine through the API guard, whose finish clears the cache."""
    from vllm.distributed.weight_transfer import ModuleSource

    from refitplane.models.tiny import load_hf_model
    from tests.support.fresh_load import differences_from_fresh, kernel_tensors, served_output
    from tests.support.offline_client import vllm_trainer_api

    llm, _ = served_a
    source = ModuleSource(load_hf_model(checkpoints.trainer, dtype=DTYPE))
    with vllm_trainer_api(llm, job="vllm-api-prefix-cache", source=source) as engine:
        engine.send_weights()
        assert engine.last_refit is not None, "send_weights returned without a refit"
        assert engine.last_refit.state.value == "COMMITTED", engine.last_refit.message
    output = served_output(llm, PROMPT, NEW_TOKENS)
    tensors = llm.collective_rpc(kernel_tensors)
    failures = differences_from_fresh(checkpoints.fresh, tensors, output)
    assert failures == [], failures[:5]
