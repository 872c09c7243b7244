"""Agents read where the coordinator is and its token from the REFIT_* environment
(`AgentSettings`), as the Helm chart sets them: the token from a mounted file
(REFIT_AUTH_TOKEN_FILE) against a coordinator that requires it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from refitplane.errors import Unauthenticated
from refitplane.generator.reference_engine import ReferenceEngine, shard_state, specs_of
from refitplane.trainer.agent import TrainerAgent

pytestmark = pytest.mark.integration

TOKEN = "agent-secret-1"
STATE = {"model.norm.weight": torch.arange(8, dtype=torch.float32)}


@pytest.fixture
def agent_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in ("REFIT_AUTH_TOKEN", "REFIT_TLS_CA_FILE", "REFIT_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no stray .env
    return monkeypatch


def _token_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    return path


def _trainer() -> TrainerAgent:
    specs = specs_of(STATE)
    shards = shard_state(specs, 0, 1, torch.device("cpu"), STATE)
    return TrainerAgent(rank=0, world_size=1, shards=shards)


def test_agents_read_the_token_file_and_the_coordinator_from_the_environment(
    coordinator_factory: Any, agent_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = _token_file(tmp_path, "token", TOKEN)
    coord = coordinator_factory(auth_token_file=str(secret))
    agent_env.setenv("REFIT_COORDINATOR", coord.grpc_target)
    agent_env.setenv("REFIT_JOB", "job")
    agent_env.setenv("REFIT_AUTH_TOKEN", "a-stale-token")  # the file wins, as documented
    agent_env.setenv("REFIT_AUTH_TOKEN_FILE", str(secret))
    trainer = _trainer()
    generator = ReferenceEngine(
        coordinator=coord.grpc_target,
        job="job",
        replica_id="rep-0",
        rank=0,
        world_size=1,
        specs=specs_of(STATE),
    )
    try:
        trainer.start()
        generator.start()
        for session in (trainer.session, generator.session):
            member = coord.core.membership.find(session.member_id)
            assert member is not None
            assert member.layout_digest
    finally:
        trainer.close()
        generator.close()


def test_a_wrong_token_in_the_file_is_refused(
    coordinator_factory: Any, agent_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    coord = coordinator_factory(auth_token_file=str(_token_file(tmp_path, "token", TOKEN)))
    agent_env.setenv("REFIT_COORDINATOR", coord.grpc_target)
    agent_env.setenv("REFIT_JOB", "job")
    agent_env.setenv("REFIT_AUTH_TOKEN_FILE", str(_token_file(tmp_path, "wrong", "nope")))
    trainer = _trainer()
    try:
        with pytest.raises(Unauthenticated):
            trainer.start()
    finally:
        trainer.close()
    assert not coord.core.membership.of_job("job")
