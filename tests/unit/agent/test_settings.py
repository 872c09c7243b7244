"""`AgentSettings`: the one reader of the REFIT_* variables agents use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from refitplane.agent.settings import AgentSettings
from refitplane.errors import FailedPrecondition
from refitplane.protocol.settings import ClientSettings

pytestmark = pytest.mark.unit


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key.startswith("REFIT_"):
            monkeypatch.delenv(key)
    return monkeypatch


def _settings() -> AgentSettings:
    return AgentSettings(_env_file=None)  # type: ignore[call-arg]


def test_every_agent_variable_is_read(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    values = {
        "REFIT_COORDINATOR": "coord:1",
        "REFIT_JOB": "grpo",
        "REFIT_REPLICA_ID": "vllm-3",
        "REFIT_HOST": "10.0.0.7",
        "REFIT_AUTH_TOKEN": "t",
        "REFIT_TLS_CA_FILE": str(ca),
        "REFIT_DELTA_SNAPSHOT": "host",
        "REFIT_FALLBACK_LAYERS": "QKVParallelLinear, ,RowParallelLinear",
    }
    for key, value in values.items():
        env.setenv(key, value)
    s = _settings()
    assert isinstance(s, ClientSettings)
    assert (s.coordinator, s.job, s.replica_id, s.host) == ("coord:1", "grpo", "vllm-3", "10.0.0.7")
    assert (s.token(), s.tls_ca(), s.delta_snapshot) == ("t", str(ca), "host")
    assert s.fallback_layer_names() == ["QKVParallelLinear", "RowParallelLinear"]
    assert s.require() == ("coord:1", "grpo")
    assert s.require(coordinator="other:2", job="ppo") == ("other:2", "ppo")


def test_unset_means_no_coordinator_not_localhost(env: pytest.MonkeyPatch) -> None:
    s = _settings()
    assert (s.coordinator, s.token(), s.tls_ca(), s.delta_snapshot) == ("", None, None, "device")
    with pytest.raises(FailedPrecondition, match="REFIT_COORDINATOR") as err:
        s.require(job="j")
    assert err.value.field == "coordinator"
    with pytest.raises(FailedPrecondition, match="REFIT_JOB") as err:
        s.require(coordinator="c:1")
    assert err.value.field == "job"


def test_the_token_file_wins_and_an_unreadable_one_is_named(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    env.setenv("REFIT_AUTH_TOKEN", "from-env")
    env.setenv("REFIT_AUTH_TOKEN_FILE", str(secret))
    assert _settings().token() == "from-file"
    env.setenv("REFIT_AUTH_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(FailedPrecondition, match=r"REFIT_AUTH_TOKEN_FILE .*missing") as err:
        _settings().token()
    assert err.value.field == "auth_token_file"
