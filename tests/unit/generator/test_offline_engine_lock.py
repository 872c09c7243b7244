"""`OfflineLLMControl.engine()`: a caller's own use of an in-process `vllm.LLM` and the
sidecar's verbs never overlap. After a failed refit the sidecar's pre-armed /update_weights
may still be in vLLM; two threads on vLLM's engine socket abort the whole process (libzmq),
as a CI run of test_vllm_staging_cpu did when its harness generated right after the refit
failed. Here `vllm.LLM` is stood in by an object whose update blocks until released, as a
pre-armed update does until its StartTransfer (or the abort) reaches the worker: the
lock's behaviour is what is under test, the real engine's is in the integration tests."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from refitplane.errors import Unavailable
from refitplane.generator.offline_control import OfflineLLMControl


class _BlockingLLM:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def update_weights(self, request: dict[str, Any]) -> None:
        self.entered.set()
        assert self.release.wait(10)


def test_the_callers_engine_waits_for_a_sidecar_verb_in_flight() -> None:
    llm = _BlockingLLM()
    control = OfflineLLMControl(llm)
    update = threading.Thread(target=control.update, args=({"refit_id": "r1"},))
    update.start()
    assert llm.entered.wait(10)
    with pytest.raises(Unavailable, match="busy with the sidecar's verbs"), control.engine(0.05):
        pass
    llm.release.set()
    update.join(10)
    with control.engine(timeout_s=10) as engine:
        assert engine is llm


def test_a_sidecar_verb_waits_while_the_caller_holds_the_engine() -> None:
    llm = _BlockingLLM()
    llm.release.set()
    control = OfflineLLMControl(llm)
    answered: list[int] = []
    with control.engine():
        update = threading.Thread(
            target=lambda: answered.append(control.update({"refit_id": "r1"}))
        )
        update.start()
        update.join(0.2)
        assert not llm.entered.is_set(), "the update reached vLLM while the caller held it"
    update.join(10)
    assert answered == [200]
