"""The trainer's weights guard: optimizer steps and refits exclude each other, and a refit
that never comes back cannot block training forever."""

from __future__ import annotations

import threading
import time

import pytest

from refitplane.errors import TransferTimeout
from refitplane.trainer.agent import WeightsGuard

pytestmark = pytest.mark.unit


def test_step_waits_for_a_refit_reading_the_weights() -> None:
    guard = WeightsGuard()
    guard.hold(timeout_s=1, expires_s=10)
    entered = threading.Event()

    def step() -> None:
        with guard.writing():
            entered.set()

    t = threading.Thread(target=step)
    t.start()
    assert not entered.wait(0.2)  # blocked while the refit holds the weights
    guard.release()
    assert entered.wait(2)
    t.join(2)


def test_refit_waits_for_a_running_step_and_times_out_clearly() -> None:
    guard = WeightsGuard()
    in_step, finish = threading.Event(), threading.Event()

    def step() -> None:
        with guard.writing():
            in_step.set()
            finish.wait(5)

    t = threading.Thread(target=step)
    t.start()
    assert in_step.wait(2)
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="optimizer step did not finish"):
        guard.hold(timeout_s=0.3, expires_s=10)
    assert time.monotonic() - started < 2
    finish.set()
    t.join(2)
    guard.hold(timeout_s=1, expires_s=10)  # free again once the step is done
    assert guard.held


def test_an_abandoned_hold_expires() -> None:
    guard = WeightsGuard()
    guard.hold(timeout_s=1, expires_s=0.3)
    started = time.monotonic()
    with guard.writing():
        waited = time.monotonic() - started
    assert 0.2 < waited < 2
    assert not guard.held


def test_writes_count_every_write_hold_begun_even_one_that_raised() -> None:
    """Sums a step's end took (`presum_after_step`) describe the weights until the next write
    hold begins: the count a PrepareRefit compares moves at every begun hold."""
    guard = WeightsGuard()
    assert guard.writes == 0
    with guard.writing():
        assert guard.writes == 1
    with pytest.raises(RuntimeError), guard.writing():
        raise RuntimeError("the step failed part-way")
    assert guard.writes == 2
    guard.hold(timeout_s=1, expires_s=10)  # a refit reading the weights counts nothing
    guard.release()
    assert guard.writes == 2
