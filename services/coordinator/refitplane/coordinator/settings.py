"""The coordinator's configuration: one typed settings object, read in `main()`.

Every field is an environment variable with the prefix `REFIT_` (also read from `.env`); the
names are a contract with the Helm chart (docs/coordinator.md has the reference table).
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from refitplane.errors import InvalidArgument
from refitplane.reshard.config import MiB, TransferConfig

# The data plane's defaults live in one place, `TransferConfig` (refitplane.reshard.config).
_TRANSFER = TransferConfig()
_TRANSFER_FIELDS = tuple(
    f.name for f in dataclasses.fields(TransferConfig) if f.name != "timeout_s"
)


class PauseMode(enum.StrEnum):
    """How a sidecar pauses vLLM during a refit (vLLM's `/pause?mode=`)."""

    KEEP = "keep"
    WAIT = "wait"
    ABORT = "abort"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="REFIT_", env_file=".env", extra="ignore", validate_default=True
    )

    grpc_host: str = "0.0.0.0"
    grpc_port: int = Field(50051, ge=0, le=65535)
    http_host: str = "0.0.0.0"
    http_port: int = Field(8080, ge=0, le=65535)
    # The control lane (docs/coordinator.md#the-control-lane), on grpc_host: agents' commands
    # and reports beside gRPC at a fraction of its per-message time. 0: any free port;
    # "off": none (agents use StreamCommands and StreamReports).
    lane_port: int | None = Field(50052, ge=0, le=65535)
    # Empty: the embedded in-process store (single-node demos; state dies with the process).
    redis_url: str = ""
    # Overrides the password in redis_url (so the URL can live in a ConfigMap).
    redis_password: SecretStr | None = None
    # A mounted secret holding the password; wins over redis_password.
    redis_password_file: Path | None = None
    auth_token: SecretStr | None = None
    # A mounted secret; wins over auth_token.
    auth_token_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    lease_ttl_s: float = Field(15.0, gt=0)
    prepare_timeout_s: float = Field(60.0, gt=0)
    transfer_timeout_s: float = Field(_TRANSFER.timeout_s, gt=0)
    group_timeout_s: float = Field(120.0, gt=0)
    # Sidecars: how long the engine may take to load, post-process and resume after the bytes.
    verify_timeout_s: float = Field(120.0, gt=0)
    # The data plane (`transfer`, one `TransferConfig` handed to every rank): flat variables
    # (REFIT_BUCKET_BYTES, ...; the chart's contract) whose defaults and checks are
    # TransferConfig's own, with REFIT_TRANSFER_TIMEOUT_S as its timeout.
    bucket_bytes: int = _TRANSFER.bucket_bytes
    num_channels: int = _TRANSFER.num_channels
    max_inflight_bytes: int = _TRANSFER.max_inflight_bytes
    verify_checksums: bool = _TRANSFER.verify_checksums
    direct_min_bytes: int = _TRANSFER.direct_min_bytes
    # Delta refits (docs/coordinator.md): "off", "auto" or "on"; a replica takes one only
    # when it holds, intact, the version every trainer rank keeps as its delta base.
    delta: Literal["off", "auto", "on"] = "off"
    # "auto": a message whose changed fraction is above this goes dense.
    delta_max_changed: float = _TRANSFER.delta_max_changed
    # Two GPUs of one node: CUDA IPC ("ipc"), NCCL P2P ("nccl") or whichever was measured
    # faster ("auto"). Ranks on one GPU always use CUDA IPC, different nodes NCCL
    # (refitplane.protocol.links; docs/deploy.md#colocated-deployments).
    same_host_transport: Literal["auto", "ipc", "nccl"] = "auto"
    # Accept trainer tensors that no generator needs (else the refit fails: model mismatch).
    allow_unused_tensors: bool = False
    # Empty: any job that has registered members.
    allowed_jobs: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Triggers per second per job (token bucket, burst = max(1, rate)); 0: unlimited.
    trigger_rate_per_s: float = Field(0.0, ge=0)
    pause_mode: PauseMode = PauseMode.KEEP
    # --- limits (docs/coordinator.md#limits): no one request may take the process down ---
    # The largest REST request body; larger ones get 413 before a byte is parsed.
    http_max_body_bytes: int = Field(1 * MiB, ge=1024)
    # The largest gRPC message the coordinator accepts; larger ones are refused before they
    # are read. Agents publish layouts in chunks below it (`LAYOUT_CHUNK_BYTES`).
    grpc_max_receive_bytes: int = Field(4 * MiB, ge=2 * MiB)
    # The most one layout published in chunks may add up to (serialized).
    max_layout_bytes: int = Field(256 * MiB, ge=1 * MiB)
    # Boxes one published layout may list for one tensor (the overlap check is O(n log n),
    # yet a layout must stay a description, not a dump).
    max_boxes_per_tensor: int = Field(32768, ge=1)
    # REST admission, per lane (reads; writes): requests served at once, requests queued
    # behind them, and how long one may wait in the queue before it gets 429 + Retry-After.
    rest_max_concurrent: int = Field(32, ge=1)
    rest_max_queued: int = Field(512, ge=0)
    rest_queue_timeout_s: float = Field(10.0, gt=0)
    # Liveness and readiness on a port and thread of their own (coordinator/probes.py), fast
    # under any REST load: None serves them only on the HTTP port (the Helm chart sets 8081;
    # 0: any free port). Plain HTTP on the HTTP host, even when REFIT_TLS_* is set.
    probe_port: int | None = Field(None, ge=0, le=65535)
    # Not live once the event loop has not run for this long (a wedged loop).
    probe_loop_stall_s: float = Field(10.0, gt=0)
    # Redis connections; a caller waits up to redis_pool_timeout_s for one instead of failing.
    redis_max_connections: int = Field(128, ge=4)
    redis_pool_timeout_s: float = Field(10.0, gt=0)
    # A job with no members and no refit running or pending for this long is forgotten: its
    # driver stops and it leaves the job set (its version counters stay). Layout documents
    # expire after layout_ttl_s unless a live member still uses them (refreshed meanwhile).
    job_idle_s: float = Field(3600.0, gt=0)
    layout_ttl_s: float = Field(7 * 86400.0, gt=0)
    log_level: str = "INFO"
    log_json: bool = False
    # One line per gRPC call and REST request (refitplane.coordinator.access; docs/operations.md).
    access_log: bool = True

    @field_validator("allowed_jobs", mode="before")
    @classmethod
    def _split_jobs(cls, value: object) -> object:
        if isinstance(value, str):
            return [j.strip() for j in value.split(",") if j.strip()]
        return value

    @field_validator("lane_port", mode="before")
    @classmethod
    def _lane_off(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("off", "none", ""):
            return None
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown log level {value!r}")
        return level

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both REFIT_TLS_CERT_FILE and REFIT_TLS_KEY_FILE, or neither")
        # Fail at start-up, not at the first refit.
        try:
            # Every TransferConfig field is a setting of the same name (its timeout is
            # REFIT_TRANSFER_TIMEOUT_S): a field added there without one fails here, loudly.
            self._transfer_config()
        except InvalidArgument as exc:
            raise ValueError(f"REFIT_{(exc.field or '').upper()}: {exc.message}") from None
        return self

    def token(self) -> str | None:
        """The bearer token agents and orchestrators must present (None: auth off)."""
        if self.auth_token_file is not None:
            return _secret_file(self.auth_token_file, "REFIT_AUTH_TOKEN_FILE")
        if self.auth_token is not None and self.auth_token.get_secret_value():
            return self.auth_token.get_secret_value()
        return None

    def _redis_password(self) -> str | None:
        if self.redis_password_file is not None:
            return _secret_file(self.redis_password_file, "REFIT_REDIS_PASSWORD_FILE")
        return self.redis_password.get_secret_value() if self.redis_password is not None else None

    def redis_dsn(self) -> str:
        """redis_url with REFIT_REDIS_PASSWORD(_FILE) applied (never log this: use
        redacted_redis_url)."""
        secret = self._redis_password() if self.redis_url else None
        if secret is None:
            return self.redis_url
        parts = urlsplit(self.redis_url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
        user = quote(parts.username or "", safe="")
        password = quote(secret, safe="")
        netloc = f"{user}:{password}@{host}{port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def redacted_redis_url(self) -> str:
        if not self.redis_url:
            return "(embedded store)"
        parts = urlsplit(self.redis_url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        given = self.redis_password is not None or self.redis_password_file is not None
        auth = "***@" if parts.password or given else ""
        return urlunsplit((parts.scheme, f"{auth}{host}{port}", parts.path, "", ""))

    @property
    def transfer(self) -> TransferConfig:
        """How the data plane runs, the same for every rank of a refit: built from the
        settings as they are now (a setting changed in place, as tests and benchmarks do
        between refits, applies to the next refit)."""
        return self._transfer_config()

    def _transfer_config(self) -> TransferConfig:
        knobs = {name: getattr(self, name) for name in _TRANSFER_FIELDS}
        return TransferConfig(timeout_s=self.transfer_timeout_s, **knobs)

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


def _secret_file(path: Path, variable: str) -> str:
    """A mounted secret's value (surrounding whitespace dropped); an empty file is an error."""
    text = path.read_text().strip()
    if not text:
        raise ValueError(f"{variable} {path} is empty")
    return text
