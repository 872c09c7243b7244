"""A replica controller (`SidecarMember`) of replica "a" of job "job", registered on a real
session, for tests that drive it over a stand-in engine against a real coordinator."""

from __future__ import annotations

from typing import Any

from refitplane.agent.session import AgentSession
from refitplane.client import RefitClient
from refitplane.replica.control import EngineControl
from refitplane.replica.controller import SidecarMember


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
