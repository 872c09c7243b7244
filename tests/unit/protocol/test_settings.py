"""Where clients and agents find the coordinator: REFIT_* variables, the token from a file."""

from __future__ import annotations

import pytest

from refitplane.protocol.settings import ClientSettings

pytestmark = pytest.mark.unit


def test_client_settings_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("REFIT_COORDINATOR", "coord:1")
    monkeypatch.setenv("REFIT_AUTH_TOKEN", "t")
    monkeypatch.setenv("REFIT_JOB", "j")
    s = ClientSettings(_env_file=None)  # type: ignore[call-arg]
    assert (s.coordinator, s.token(), s.job) == ("coord:1", "t", "j")
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    monkeypatch.setenv("REFIT_AUTH_TOKEN_FILE", str(f))
    assert ClientSettings(_env_file=None).token() == "from-file"  # type: ignore[call-arg]
