"""The bookkeeping of vLLM's update sessions on one worker (`UpdateSessions`): a version is
held only after a finish that applies a verified refit; a discard or dropped weights make the
open session apply nothing. The engine around it: test_vllm_sleep_guard.py, and the real
vLLM server in tests/integration/generator/test_vllm_api_contract_cpu.py."""

from __future__ import annotations

import pytest

from refitplane.generator.vllm_contract import RefitUpdateInfo
from refitplane.generator.vllm_update_session import UpdateSessions

pytestmark = pytest.mark.unit


def _verified(sessions: UpdateSessions, refit_id: str, version: int) -> None:
    sessions.start()
    sessions.record(RefitUpdateInfo(refit_id=refit_id), ok=True)
    sessions.verified(refit_id, version)


def test_a_finish_that_applies_holds_the_coordinators_version() -> None:
    sessions = UpdateSessions()
    _verified(sessions, "r1", 7)
    assert sessions.serves_held() is None  # open: the answer is about to change
    updates, refit_id, version = sessions.take()
    assert (refit_id, version, [u["refit_id"] for u in updates]) == ("r1", 7, ["r1"])
    assert sessions.take() == ([], "", 0)  # taken once
    assert sessions.version == 0  # not before the finish applied it
    sessions.end("applied", "refit r1", version=version)
    assert (sessions.version, sessions.applied_sessions, sessions.open) == (7, 1, False)
    assert sessions.serves_held() is True


def test_a_session_that_did_not_apply_keeps_the_version_held_before() -> None:
    sessions = UpdateSessions()
    _verified(sessions, "r1", 3)
    sessions.take()
    sessions.end("applied", "refit r1", version=3)
    _verified(sessions, "r2", 4)
    sessions.take()
    sessions.end("failed", "refit r2: checksum mismatch", version=4)
    assert (sessions.version, sessions.last, sessions.incomplete) == (3, "failed", False)
    _verified(sessions, "r3", 5)
    sessions.take()
    sessions.end("incomplete", "reload failed")
    assert (sessions.version, sessions.incomplete, sessions.serves_held()) == (3, True, False)


def test_a_discard_happens_once_and_only_in_an_open_session() -> None:
    sessions = UpdateSessions()
    assert sessions.discard("no session") is False
    _verified(sessions, "r1", 2)
    assert sessions.discard("failed on another rank") is True
    assert sessions.discard("again") is False
    assert (sessions.discarded, sessions.last_message) == (True, "failed on another rank")
    assert sessions.take()[1:] == ("", 0)  # nothing left to apply


def test_dropped_weights_hold_no_version_and_apply_nothing() -> None:
    sessions = UpdateSessions()
    _verified(sessions, "r1", 6)
    sessions.take()
    sessions.end("applied", "refit r1", version=6)
    assert sessions.weights_gone("sleep level 2") is False  # no session open
    assert (sessions.version, sessions.incomplete, sessions.serves_held()) == (0, True, False)
    _verified(sessions, "r2", 7)
    assert sessions.weights_gone("sleep level 2 mid-update") is True
    assert sessions.take()[1:] == ("", 0)
