"""A replica controller (`SidecarMember`) of replica "a" of job "job", registered on a real
session, for tests that drive it over a stand-in engine against a real coordinator; and a
sidecar's start that must fail (`failed_start`)."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import pytest

from refitplane.agent.session import AgentSession
from refitplane.client import RefitClient
from refitplane.errors import RefitError
from refitplane.replica.control import EngineControl
from refitplane.replica.controller import SidecarMember

_Failure = TypeVar("_Failure", bound=RefitError)


def start_controller(
    target: str, engine: EngineControl, client: RefitClient, **options: Any
) -> tuple[SidecarMember, AgentSession]:
    """`options`: SidecarMember's keyword arguments (verify_wait_s, metrics, ...). The
    caller closes the session."""
    member = SidecarMember(
        engine, client, job="job", replica_id="a", default_pause_mode="keep", **options
    )
    session = member.connect(target, host="127.0.0.1", token=None, tls_ca=None)
    session.start()
    return member, session


def failed_start(sidecar: Any, expected: type[_Failure]) -> tuple[_Failure, float]:
    """Start `sidecar` (a `Sidecar`), which must fail with `expected`, then close it: the
    error, and how many seconds the start took."""
    started = time.monotonic()
    try:
        with pytest.raises(expected) as caught:
            sidecar.start()
    finally:
        sidecar.close()
    assert not sidecar.alive
    return caught.value, time.monotonic() - started
