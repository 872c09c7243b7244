"""One list of failure reasons: every error class, the coordinator's failures and what
clients compare `Refit.reason` against use `refitplane.protocol.Reason`."""

from __future__ import annotations

import pytest

import refitplane.agent.simulated
import refitplane.cli.exits
import refitplane.client
import refitplane.errors as errors
import refitplane.generator.vllm_verb_flows
from refitplane.coordinator.core.failures import RefitFailed
from refitplane.coordinator.core.membership import Departure
from refitplane.protocol import Reason, RefitState
from refitplane.protocol.models import Refit

pytestmark = pytest.mark.unit


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def test_every_error_class_carries_a_listed_reason() -> None:
    classes = _subclasses(errors.RefitError)
    assert refitplane.agent.simulated.SimulatedFailure in classes
    assert refitplane.cli.exits.UsageError in classes
    assert refitplane.generator.vllm_verb_flows.InfoError in classes
    assert RefitFailed in classes  # the coordinator's failures are RefitErrors too
    unlisted = [c.__qualname__ for c in classes if c.reason not in set(Reason)]
    assert not unlisted


def test_a_departure_fails_a_refit_with_a_listed_reason() -> None:
    assert {d.value for d in Departure} <= set(Reason)


def test_refit_failed_keeps_its_reason_and_says_it() -> None:
    failure = RefitFailed(Reason.GROUP_FAILED, "no rendezvous")
    assert isinstance(failure, errors.RefitError)
    assert (failure.reason, failure.message) == (Reason.GROUP_FAILED, "no rendezvous")
    assert str(failure) == "GROUP_FAILED: no rendezvous"
    # An agent's own reason passes through as its string.
    assert RefitFailed("SOMETHING_NEW", "x").reason == "SOMETHING_NEW"


def test_clients_compare_a_refits_reason_with_the_constant() -> None:
    assert refitplane.client.Reason is Reason
    refit = Refit(
        refit_id="r", job="j", version=1, state=RefitState.FAILED, reason="TIMEOUT", message="m"
    )
    assert refit.reason == Reason.TIMEOUT
    assert refit.reason != Reason.CANCELLED
