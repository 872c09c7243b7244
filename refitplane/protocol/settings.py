"""Where clients and agents find the coordinator: REFIT_* environment variables (and .env).
Public as `refitplane.client.ClientSettings`."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REFIT_", env_file=".env", extra="ignore")

    # gRPC host:port of the coordinator
    coordinator: str = "localhost:50051"
    # REST base URL (e.g. http://refit-coordinator:8080)
    coordinator_http: str = "http://localhost:8080"
    auth_token: SecretStr | None = None
    # A mounted secret; wins over auth_token.
    auth_token_file: Path | None = None
    # CA bundle for a TLS coordinator (unset: plaintext)
    tls_ca_file: Path | None = None
    job: str = ""
    # Agents: send reports on a StreamReports stream held open (false: every report by the
    # unary Report, for A/B runs; docs/coordinator.md#the-report-path).
    report_stream: bool = True
    # Agents: commands and reports on the coordinator's control lane when it has one (false:
    # gRPC's streams only; docs/coordinator.md#the-control-lane).
    lane: bool = True
    # Agents: dial the control lane here ("host:port") instead of the gRPC target's host at
    # the port the coordinator names (a lane port remapped by a proxy, NodePort or LB).
    lane_target: str = ""

    def token(self) -> str | None:
        if self.auth_token_file is not None:
            return self.auth_token_file.read_text().strip() or None
        if self.auth_token is not None:
            return self.auth_token.get_secret_value() or None
        return None
