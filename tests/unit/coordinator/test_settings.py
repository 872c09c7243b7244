"""The coordinator's settings: REFIT_* names (a contract with the Helm chart), parsing,
secrets never shown, consistency checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from refitplane.coordinator.settings import PauseMode, Settings
from refitplane.reshard.config import TransferConfig

pytestmark = pytest.mark.unit


@pytest.fixture
def env(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("REFIT_"):
            monkeypatch.delenv(key)
    return monkeypatch


def _settings(**kw):
    return Settings(_env_file=None, **kw)  # type: ignore[call-arg]


def test_defaults(env):
    s = _settings()
    assert (s.grpc_host, s.grpc_port, s.http_host, s.http_port) == (
        "0.0.0.0",
        50051,
        "0.0.0.0",
        8080,
    )
    assert s.redis_url == ""
    assert s.token() is None
    assert s.lease_ttl_s == 15
    assert s.prepare_timeout_s == 60
    assert s.transfer_timeout_s == 300
    assert s.group_timeout_s == 120
    assert s.bucket_bytes == 64 << 20
    assert s.num_channels == 2
    assert s.max_inflight_bytes == 256 << 20
    assert s.verify_checksums is True
    assert s.allowed_jobs == []
    assert s.trigger_rate_per_s == 0
    assert s.pause_mode is PauseMode.KEEP
    assert s.log_level == "INFO"
    assert s.log_json is False
    # The data plane's defaults are TransferConfig's own, not restated.
    assert s.transfer == TransferConfig()
    assert s.transfer.timeout_s == 300


def test_every_contract_variable_is_read(env, tmp_path):
    cert, key = tmp_path / "c", tmp_path / "k"
    cert.write_text("c")
    key.write_text("k")
    values = {
        "REFIT_GRPC_HOST": "127.0.0.1",
        "REFIT_GRPC_PORT": "1",
        "REFIT_HTTP_HOST": "::1",
        "REFIT_HTTP_PORT": "2",
        "REFIT_REDIS_URL": "redis://r:6379/1",
        "REFIT_REDIS_PASSWORD": "pw",
        "REFIT_AUTH_TOKEN": "t",
        "REFIT_TLS_CERT_FILE": str(cert),
        "REFIT_TLS_KEY_FILE": str(key),
        "REFIT_LEASE_TTL_S": "3",
        "REFIT_PREPARE_TIMEOUT_S": "4",
        "REFIT_TRANSFER_TIMEOUT_S": "5",
        "REFIT_GROUP_TIMEOUT_S": "6",
        "REFIT_BUCKET_BYTES": "1024",
        "REFIT_NUM_CHANNELS": "4",
        "REFIT_MAX_INFLIGHT_BYTES": "4096",
        "REFIT_VERIFY_CHECKSUMS": "false",
        "REFIT_DIRECT_MIN_BYTES": "512",
        "REFIT_DELTA": "auto",
        "REFIT_DELTA_MAX_CHANGED": "0.25",
        "REFIT_ALLOWED_JOBS": "a, b,,c",
        "REFIT_TRIGGER_RATE_PER_S": "2.5",
        "REFIT_PAUSE_MODE": "abort",
        "REFIT_LOG_LEVEL": "debug",
        "REFIT_LOG_JSON": "1",
    }
    for k, v in values.items():
        env.setenv(k, v)
    s = _settings()
    assert (s.grpc_host, s.grpc_port, s.http_host, s.http_port) == ("127.0.0.1", 1, "::1", 2)
    assert s.redis_dsn() == "redis://:pw@r:6379/1"
    assert s.token() == "t"
    assert s.tls
    assert (s.lease_ttl_s, s.prepare_timeout_s, s.transfer_timeout_s, s.group_timeout_s) == (
        3,
        4,
        5,
        6,
    )
    config = s.transfer
    assert (config.bucket_bytes, config.num_channels, config.max_inflight_bytes) == (1024, 4, 4096)
    assert config.verify_checksums is False
    assert (config.timeout_s, config.direct_min_bytes) == (5, 512)
    assert (config.delta, config.delta_max_changed) == ("auto", 0.25)
    assert s.allowed_jobs == ["a", "b", "c"]
    assert s.trigger_rate_per_s == 2.5
    assert s.pause_mode is PauseMode.ABORT
    assert s.log_level == "DEBUG"
    assert s.log_json is True


def test_token_file_wins_and_empty_file_is_an_error(env, tmp_path):
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert _settings(auth_token="from-env", auth_token_file=f).token() == "from-file"
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        _settings(auth_token_file=f).token()


def test_redis_password_file_wins_and_is_redacted(env, tmp_path):
    f = tmp_path / "redis-password"
    f.write_text("p@ss/file\n")
    s = _settings(redis_url="redis://host:1/0", redis_password="from-env", redis_password_file=f)
    assert s.redis_dsn() == "redis://:p%40ss%2Ffile@host:1/0"
    assert s.redacted_redis_url() == "redis://***@host:1/0"
    assert "p@ss" not in repr(s)
    f.write_text("")
    with pytest.raises(ValueError, match=r"REFIT_REDIS_PASSWORD_FILE .* is empty"):
        s.redis_dsn()
    # The embedded store needs no password: the file is not read.
    assert _settings(redis_password_file=tmp_path / "absent").redis_dsn() == ""


def test_secrets_are_not_shown(env):
    s = _settings(
        auth_token="tok-123", redis_url="redis://user:urlpw@host:1/0", redis_password="pw-456"
    )
    text = repr(s) + str(s.model_dump())
    assert "tok-123" not in text
    assert "pw-456" not in text
    assert s.redacted_redis_url() == "redis://***@host:1/0"
    assert "urlpw" not in s.redacted_redis_url()
    assert s.redis_dsn() == "redis://user:pw-456@host:1/0"
    assert _settings().redacted_redis_url() == "(embedded store)"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tls_cert_file": "/c"}, "TLS"),
        ({"bucket_bytes": 2048, "max_inflight_bytes": 1024}, "REFIT_MAX_INFLIGHT_BYTES"),
        ({"num_channels": 0}, "REFIT_NUM_CHANNELS"),
        ({"delta_max_changed": 1.5}, "REFIT_DELTA_MAX_CHANGED"),
        ({"direct_min_bytes": 0}, "REFIT_DIRECT_MIN_BYTES"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"pause_mode": "later"}, "pause_mode"),
        ({"log_level": "loud"}, "log level"),
    ],
)
def test_inconsistent_settings_fail_at_start(env, kw, message):
    with pytest.raises(ValidationError, match=message):
        _settings(**kw)


def test_a_setting_changed_in_place_reaches_the_next_transfer_config(env):
    """Tests and benchmarks change a running coordinator's settings between refits
    (`refit_world.World.configure`): the data plane's config follows."""
    s = _settings()
    assert s.transfer.delta == "off"
    s.delta = "auto"
    s.bucket_bytes = 1 << 20
    assert (s.transfer.delta, s.transfer.bucket_bytes) == ("auto", 1 << 20)
