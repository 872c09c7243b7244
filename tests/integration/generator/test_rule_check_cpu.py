"""Rules prove themselves at engine start: a loader transform no rule models is caught.

A vLLM plugin (`tests.support.permuted_loader`) makes the model's `load_weights` reverse the
rows of every `mlp.up_proj.weight` before the layers see it, as Llama 4's loader permutes
q/k rows. The `MergedColumnParallelLinear` rule (`gate_up_proj`: rank r holds rows
`[r·I/2, (r+1)·I/2)` of `up_proj`) then describes the wrong rows at TP 2. The engine's
start-up check feeds the loader coordinate-coded tensors for one layer, sees where they land
(`vllm_rule_check`), and moves the class to the fallback path; the refit is then byte-equal
to a fresh load made with the same loader. Without the check the refit sends each rank the
rows the rule names, the loader reverses the staged tensor, and the rank loads the other
rank's (never sent, zero) rows: the replica differs from the fresh load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refitplane.cli.refit_cmds import topology_text
from refitplane.models.tiny import confident_seed
from tests.integration.generator.vllm_refits import JOB, RefitSession
from tests.integration.vllm_marks import VLLM_CPU
from tests.support.fresh_load import differences_from_fresh, fresh_load
from tests.support.permuted_loader import permuted_loader

pytestmark = VLLM_CPU

PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6
MOVED = "MergedColumnParallelLinear"


def _rule_checks(worker: Any) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = worker.weight_transfer_engine.status()["rule_checks"]
    return checks


def test_a_loader_transform_no_rule_models_moves_its_class_to_the_fallback(
    tmp_path: Path,
) -> None:
    from refitplane.testing.vllm_cpu import greedy_tokens, vllm_cpu_engine

    seeds = {"prompt_token_ids": PROMPT, "max_new_tokens": NEW_TOKENS}
    _, served_dir = confident_seed(tmp_path / "a", "dense", start=100, tries=60, **seeds)
    _, trainer_dir = confident_seed(tmp_path / "b", "dense", start=200, tries=60, **seeds)
    with permuted_loader(tmp_path / "plugin", "mlp.up_proj.weight") as env:
        fresh = fresh_load(
            trainer_dir, prompt=PROMPT, new_tokens=NEW_TOKENS, tensor_parallel_size=2, env=env
        )
        with vllm_cpu_engine(
            served_dir,
            tensor_parallel_size=2,
            weight_transfer_config={"backend": "refitplane"},
            env=env,
        ) as llm:
            before = greedy_tokens(llm, PROMPT, NEW_TOKENS)
            session = RefitSession(llm, prompt=PROMPT, new_tokens=NEW_TOKENS, generates=True)
            try:
                topology = session.client.topology(JOB)
                refit = session.refit_checkpoint(trainer_dir, "tp", 2)
            finally:
                session.close()
            checks = llm.collective_rpc(_rule_checks)

    assert refit.state == "COMMITTED", (refit.reason, refit.message)
    for report in refit.worker_reports:
        assert report["failures"] == [], report["failures"][:5]
    failures = differences_from_fresh(fresh, refit.kernel_tensors, refit.output)
    assert failures == [], failures[:10]
    # Every rank checked every rule class once at start; only the broken one moved.
    for rank_checks in checks:
        by_class = {c["class"]: c for c in rank_checks}
        assert by_class[MOVED]["status"] == "mismatch", by_class[MOVED]
        assert "up_proj.weight" in by_class[MOVED]["reason"], by_class[MOVED]
        others = {c: v["status"] for c, v in by_class.items() if c != MOVED}
        assert others, by_class
        assert set(others.values()) == {"verified"}, others
    # The decision is in the worker's registration, and `refitctl topology` says it.
    generators = [m for m in topology.members if m.role.value == "GENERATOR"]
    assert [m.labels["rules_moved"] for m in generators] == [MOVED, MOVED]
    assert f"rules moved to fallback at start: {MOVED}" in topology_text(topology)

    # The checkpoints differ where the prompt can see it: the comparison can fail.
    assert fresh.output.tokens != before
