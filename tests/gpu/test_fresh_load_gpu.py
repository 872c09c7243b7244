"""The fresh-load oracle on one GPU (vLLM 0.26): a refit's receive path leaves the replica
equal to a fresh vLLM load of the same checkpoint.

For the shaped models of `test_model_coverage_gpu.py` (DeepSeek-V2-Lite shape,
Nemotron-3-Nano-shaped hybrid, Qwen3 FP8 block-quantized with KV-cache scales, a two-layer
Qwen3-MoE block-FP8; bf16), once per case (the module-scoped `case_run`):

1. the checkpoint is written and a fresh `LLM` loads it (`load_format="auto"`): every kernel
   tensor of every module (parameters, buffers, tensor attributes of modules and their
   helper objects: `tests.support.fresh_load.kernel_tensors`) and the greedy tokens with
   top-5 log-probs are kept, and the engine stops;

then per receive binding:

2. a second `LLM` starts from dummy weights; in its worker the engine's receive path
   (`vllm_checks.receive_checkpoint`: "auto", the mixed binding on a GPU — live fast path,
   the rest staged with its layer, fallback tensors whole — or "staged", everything staged
   and applied at finish) fills it from the checkpoint;
3. every kernel tensor equals the fresh load's, byte for byte, and the served tokens and
   log-probs are the fresh load's (up to its first near-tie).

Each receive starts from dummy weights in an engine of its own, so nothing one binding
leaves stale is hidden by another. "live" binds on a GPU exactly what "auto" binds there
(`vllm_staging.modes_binding_as_auto`): its case checks that "auto" resolved to that binding
and passed, without an engine of its own. A case thus costs 1 + 2 engine starts (it cost 6:
a fresh load per mode, and an engine for "live"). The "auto" engine of the cases
`test_model_coverage_gpu.py` checks also runs vLLM's own reload after its check
(`reload_differences`), for that file to judge in the same pytest process without an engine.

The data plane itself needs two GPUs (trainer and vLLM): `test_vllm_refit_gpu.py`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.test_model_coverage_gpu import COVERAGE_CASES, _checkpoint, _vllm
from tests.gpu.vllm_case import NEEDS_VLLM, NEW_TOKENS, PROMPT
from tests.support.fresh_load import FreshLoad

pytestmark = [NEEDS_VLLM, pytest.mark.gpu(count=1)]


@dataclass(frozen=True)
class Received:
    """One dummy engine filled through the receive path: its report and every difference
    from the fresh load."""

    report: dict[str, Any]
    failures: list[str]


@dataclass
class CaseRun:
    """A case's checkpoint and fresh load, shared by its modes, and what each receive gave."""

    case: str
    model_dir: Path
    extra: dict[str, Any]
    fresh: FreshLoad
    received: dict[str, Received] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)


@pytest.fixture(scope="module")
def case_run(case: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CaseRun]:
    from tests.support.fresh_load import snapshot_fresh

    root = tmp_path_factory.mktemp(case)
    model_dir, extra = _checkpoint(case, root / case)
    with _vllm(model_dir, load_format="auto", **extra) as llm:
        fresh = snapshot_fresh(llm, model_dir, PROMPT, NEW_TOKENS)
    yield CaseRun(case, model_dir, extra, fresh)
    shutil.rmtree(root, ignore_errors=True)  # GBs a case: gone before the next one's


@pytest.mark.parametrize("mode", ["auto", "live", "staged"])
@pytest.mark.parametrize(
    "case", ["nemotron-h", "deepseek-v2-lite", "qwen3-fp8-kv", "qwen3-moe-fp8"], scope="module"
)
def test_receive_path_equals_a_fresh_load(
    case: str, mode: str, case_run: CaseRun, reload_reports: dict[str, dict[str, Any]]
) -> None:
    from refitplane.generator.vllm_staging import modes_binding_as_auto

    if mode == "live":
        if "auto" in case_run.tried and "auto" not in case_run.received:
            pytest.fail(f"the auto receive of {case} (the same binding) did not finish")
        auto = case_run.received.get("auto") or _receive(case_run, "auto", reload_reports)
        alike = modes_binding_as_auto(auto.report["mode"], on_gpu=True)
        print(f"{case} (live): binds as auto, which resolved to {auto.report['mode']}")
        assert "live" in alike, f"auto resolved to {auto.report['mode']}: live needs an engine"
        assert auto.failures == [], ["the auto receive (the same binding)", *auto.failures[:10]]
        return
    received = _receive(case_run, mode, reload_reports)
    assert received.failures == [], received.failures[:10]
    if mode == "staged":
        assert received.report["mode"] == "staged"


def _receive(run: CaseRun, mode: str, reload_reports: dict[str, dict[str, Any]]) -> Received:
    """A dummy engine filled through the receive path in `mode`, compared with the fresh
    load (every difference printed as found: a job cut short still shows them); the "auto"
    engine of a coverage case then runs vLLM's reload for `test_model_coverage_gpu.py`."""
    from refitplane.testing.kernel_tensors import kernel_tensors
    from tests.support.fresh_load import differences_from_fresh, served_output
    from tests.support.vllm_checks import receive_checkpoint, reload_differences

    run.tried.add(mode)
    with _vllm(run.model_dir, **run.extra) as llm:  # dummy weights: the receive fills it
        (report,) = llm.collective_rpc(receive_checkpoint, args=(str(run.model_dir), mode))
        output = served_output(llm, PROMPT, NEW_TOKENS)
        tensors = llm.collective_rpc(kernel_tensors)
        print(f"{run.case} ({mode}): {report['mode']}, {report['summary']}")
        failures = differences_from_fresh(run.fresh, tensors, output)
        for failure in failures:
            print(f"{run.case} ({mode}): {failure}", flush=True)
        run.received[mode] = Received(report, failures)
        if mode == "auto" and run.case in COVERAGE_CASES:
            try:
                (reloaded,) = llm.collective_rpc(reload_differences, args=(str(run.model_dir),))
                reload_reports[run.case] = {**report, **reloaded}
            except Exception as error:  # the coverage test's failure, not this one's
                reload_reports[run.case] = {**report, "error": repr(error)}
    return run.received[mode]
