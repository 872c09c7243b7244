"""The refitplane backend's contract for vLLM's weight-transfer verbs, as logic: payload
validation (every problem names its field) and the decisions each verb's flow takes from
the workers' statuses (which RPCs go out, which version is set, which error is raised).

The workers' statuses here are what `RefitplaneEngine.status()` returns; the real engine,
the real API server and real vLLM workers run in
tests/integration/generator/test_vllm_api_contract_cpu.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from refitplane.agent.settings import AgentSettings
from refitplane.errors import RefitError
from refitplane.generator import vllm_contract as c
from refitplane.generator import vllm_verb_flows as f

pytestmark = pytest.mark.unit

GOOD_INIT = {"coordinator": "coord:50051", "job": "j", "replica_id": "r"}


def _status(**overrides: Any) -> c.EngineStatus:
    status: dict[str, Any] = {
        "rank": 0,
        "replica": "r",
        "initialized": True,
        "error": "",
        "session": True,
        "updates": [],
        "discarded": False,
        "last": "none",
        "last_message": "",
        "incomplete": False,
        "applied_sessions": 0,
        "receive_mode": "staged",
        "draft": "none",
    }
    status.update(overrides)
    return status  # type: ignore[return-value]


def _update(ok: bool = True, reason: str = "", modified: bool = False) -> c.UpdateRecord:
    return c.UpdateRecord(
        refit_id="r1", action="receive", ok=ok, reason=reason, message=reason, modified=modified
    )


def _run(
    flow: f.Flow, answer: Callable[[f.Step], Any]
) -> tuple[list[f.Step], f.FlowOutcome | BaseException]:
    """Drive a flow as the API guard does; returns the steps it took and its outcome."""
    steps: list[f.Step] = []
    try:
        step = next(flow)
        while True:
            steps.append(step)
            step = flow.send(answer(step))
    except StopIteration as done:
        return steps, done.value
    except RefitError as exc:
        return steps, exc


def _workers(*before: c.EngineStatus, after: list[c.EngineStatus] | None = None) -> Any:
    """Status replies: `before` until the verb's own RPC went out, `after` from then on."""
    state = {"sent": False}

    def answer(step: f.Step) -> Any:
        if isinstance(step, f.GetVersion):
            return "7"
        if isinstance(step, f.Rpc) and step.method != c.ENGINE_ATTR:
            state["sent"] = True
        if step == f.STATUS:
            return list(after if state["sent"] and after is not None else before)
        return None

    return answer


def test_init_info_problems_name_their_fields() -> None:
    nothing = AgentSettings.model_construct()  # no REFIT_* variables at all
    _, problems = c.parse_init_info({**GOOD_INIT, "jbo": "x", "mode": "fast"}, env=nothing)
    assert [p.field for p in problems] == ["init_info.jbo", "init_info.mode"]
    _, problems = c.parse_init_info({"coordinator": 5, "fallback_layers": [1]}, env=nothing)
    assert [p.field for p in problems] == [
        "init_info.coordinator",
        "init_info.fallback_layers",
        "init_info.coordinator",
        "init_info.job",
        "init_info.replica_id",
    ]
    # Missing fields may come from the workers' environment, as the engine reads them.
    env = AgentSettings.model_construct(coordinator="c:1", job="j", replica_id="r")
    assert c.parse_init_info({}, env=env)[1] == []
    assert c.parse_init_info([], env=env)[1][0].field == "init_info"


def test_update_info_problems_name_their_fields() -> None:
    assert c.parse_update_info({"refit_id": "a"})[1] == []
    assert c.parse_update_info({"action": "discard"})[1] == []
    cases = {
        "update_info.refit_id": {"version": 1},
        "update_info.version": {"refit_id": "a", "version": True},
        "update_info.action": {"refit_id": "a", "action": "apply"},
        "update_info.prepare_wait_s": {"refit_id": "a", "prepare_wait_s": 1e9},
        "update_info.start_wait_s": {"refit_id": "a", "start_wait_s": -1},
        "update_info.bogus": {"refit_id": "a", "bogus": 1},
    }
    for field, payload in cases.items():
        assert c.parse_update_info(payload)[1][0].field == field, payload


def test_an_update_info_without_start_wait_receives_at_once() -> None:
    """Old callers (the vLLM-API path, an RL loop's own /update_weights) send no
    start_wait_s: the worker receives at once, as before the pre-armed update."""
    info, problems = c.parse_update_info({"refit_id": "a", "version": 2})
    assert problems == []
    assert info.start_wait_s == 0.0
    info, problems = c.parse_update_info({"refit_id": "a", "start_wait_s": 60})
    assert problems == []
    assert info.start_wait_s == 60


def test_a_bad_payload_sends_nothing() -> None:
    steps, outcome = _run(f.init_flow({"job": 3}), _workers(_status()))
    assert steps == []
    assert isinstance(outcome, f.InfoError)
    assert outcome.field == "init_info.job"
    steps, outcome = _run(f.update_flow([{"refit_id": "a"}, {}]), _workers(_status()))
    assert steps == []
    assert isinstance(outcome, f.InfoError)
    assert outcome.field == "update_info[1].refit_id"


def test_verbs_out_of_order_are_refused_before_the_rpc() -> None:
    idle = _status(session=False)
    for flow in (f.update_flow({"refit_id": "a"}), f.finish_flow("1")):
        steps, outcome = _run(flow, _workers(idle, _status()))
        assert steps == [f.STATUS]
        assert isinstance(outcome, f.StateConflict)
    steps, outcome = _run(f.start_flow(), _workers(_status(), _status(session=False)))
    assert steps == [f.STATUS]
    assert isinstance(outcome, f.StateConflict)
    steps, outcome = _run(f.shutdown_flow(), _workers(_status(), _status(session=False)))
    assert steps == [f.STATUS]
    assert isinstance(outcome, f.StateConflict)
    _, outcome = _run(f.start_flow(draft=True), _workers(idle))
    assert isinstance(outcome, f.DraftUnsupported)


def test_a_draft_update_is_an_ordinary_update_where_every_rank_refits_its_draft() -> None:
    """/start_draft_weight_update: vLLM's own draft session (the draft alone) never opens;
    where every rank refits its draft with the target, the ordinary update starts (one
    refit, one version); elsewhere a 501 that says why, before any RPC."""
    refit = [_status(rank=r, session=False, draft="refit") for r in range(2)]
    steps, outcome = _run(f.start_flow(draft=True), _workers(*refit))
    assert steps == [f.STATUS, f.Rpc("start_weight_update")]
    assert isinstance(outcome, f.FlowOutcome)
    for draft, says in (("keep", 'init_info.draft "keep"'), ("none", "serves no draft")):
        mixed = [_status(rank=0, session=False, draft="refit"), _status(rank=1, draft=draft)]
        steps, outcome = _run(f.start_flow(draft=True), _workers(*mixed))
        assert steps == [f.STATUS]
        assert isinstance(outcome, f.DraftUnsupported)
        assert "rank 1" in outcome.message, outcome.message
        assert says in outcome.message, outcome.message
    _, problems = c.parse_init_info({**GOOD_INIT, "draft": "always"})
    assert [p.field for p in problems] == ["init_info.draft"]


def test_an_update_fails_when_any_rank_did_not_verify() -> None:
    before = [_status(rank=0), _status(rank=1)]
    after = [
        _status(rank=0, updates=[_update()]),
        _status(rank=1, updates=[_update(ok=False, reason="FAILED_PRECONDITION")]),
    ]
    _, outcome = _run(f.update_flow({"refit_id": "r1"}), _workers(*before, after=after))
    assert isinstance(outcome, f.EngineFailed)
    assert outcome.caller_fault
    assert "did not verify on 1 of 2 rank(s)" in outcome.message
    assert "r rank 1" in outcome.message
    after[1] = _status(rank=1, updates=[_update(ok=False, reason="CHECKSUM_MISMATCH")])
    _, outcome = _run(f.update_flow({"refit_id": "r1"}), _workers(*before, after=after))
    assert isinstance(outcome, f.EngineFailed)
    assert not outcome.caller_fault


def test_finish_sets_the_version_only_when_every_rank_applied() -> None:
    applied = _status(session=False, last="applied", applied_sessions=1)
    steps, outcome = _run(
        f.finish_flow("8"), _workers(_status(updates=[_update()]), after=[applied])
    )
    assert steps == [
        f.STATUS,
        f.Rpc("finish_weight_update"),
        f.STATUS,
        f.CLEAR_PREFIX_CACHE,
        f.SetVersion("8"),
    ]
    assert outcome == f.FlowOutcome(unlabeled=False)
    # No version given: the applied update waits for one (update_weight_version).
    _, outcome = _run(f.finish_flow(None), _workers(_status(updates=[_update()]), after=[applied]))
    assert outcome == f.FlowOutcome(unlabeled=True)


def test_an_applied_update_whose_prefix_cache_stays_is_not_reported_as_a_version() -> None:
    """An offline engine's prefix cache that vLLM could not clear (it answers False while
    requests run) would serve cached prompts from the old weights: no version is set."""
    applied = _status(session=False, last="applied", applied_sessions=1)
    workers = _workers(_status(updates=[_update()]), after=[applied])

    def answer(step: f.Step) -> Any:
        return False if isinstance(step, f.ClearPrefixCache) else workers(step)

    steps, outcome = _run(f.finish_flow("8"), answer)
    assert f.SetVersion("8") not in steps
    assert steps[-1] == f.SetVersion(c.INCOMPLETE_VERSION)
    assert isinstance(outcome, f.EngineFailed)
    assert "prefix cache" in outcome.message
    # Nothing applied (a discarded update): nothing to clear.
    failed = _status(session=False, last="failed")
    steps, _ = _run(f.finish_flow("9"), _workers(_status(updates=[_update()]), after=[failed]))
    assert f.CLEAR_PREFIX_CACHE not in steps


def test_finish_after_a_failed_rank_discards_everywhere_and_sets_no_version() -> None:
    before = [_status(rank=0, updates=[_update()]), _status(rank=1, updates=[_update(ok=False)])]
    failed = _status(session=False, last="failed", last_message="peer died")
    steps, outcome = _run(f.finish_flow("99"), _workers(*before, after=[failed, failed]))
    assert steps[:3] == [f.STATUS, f.DISCARD, f.Rpc("finish_weight_update")]
    assert not any(isinstance(s, f.SetVersion) for s in steps)
    assert isinstance(outcome, f.StateConflict)
    assert "'99' was not set" in outcome.message
    assert "still serves '7'" in outcome.message


def test_weights_touched_without_verification_are_not_reported_as_a_version() -> None:
    broken = _status(session=False, last="incomplete", incomplete=True, last_message="reload")
    steps, outcome = _run(
        f.finish_flow("9"), _workers(_status(updates=[_update(modified=True)]), after=[broken])
    )
    assert f.SetVersion(c.INCOMPLETE_VERSION) in steps
    assert f.SetVersion("9") not in steps
    assert isinstance(outcome, f.EngineFailed)
    _, outcome = _run(f.update_version_flow("9", unlabeled=True), _workers(broken))
    assert isinstance(outcome, f.StateConflict)


def test_a_version_names_an_applied_update_the_loaded_weights_or_the_current_one() -> None:
    applied = _status(session=False, last="applied", applied_sessions=1)
    assert _run(f.update_version_flow("8", unlabeled=True), _workers(applied))[0][-1] == (
        f.SetVersion("8")
    )
    as_loaded = _status(session=False)
    assert _run(f.update_version_flow("0", unlabeled=False), _workers(as_loaded))[0][-1] == (
        f.SetVersion("0")
    )
    assert _run(f.update_version_flow("7", unlabeled=False), _workers(applied))[0][-1] == (
        f.SetVersion("7")
    )
    _, outcome = _run(f.update_version_flow("8", unlabeled=False), _workers(applied))
    assert isinstance(outcome, f.StateConflict)
