"""What every agent reads from its environment, in one place: the trainer agent, both vLLM
engines (trainer and generator side), the reference engine and the sidecar.

`AgentSettings` is `ClientSettings` (REFIT_COORDINATOR, REFIT_AUTH_TOKEN, REFIT_AUTH_TOKEN_FILE,
REFIT_TLS_CA_FILE, REFIT_JOB; also read from `.env`) plus what an agent says about itself
(REFIT_REPLICA_ID, REFIT_HOST) and its engine's knobs (REFIT_DELTA_SNAPSHOT,
REFIT_FALLBACK_LAYERS). Everywhere an explicit argument or init-info field wins over it.
"""

from __future__ import annotations

from pydantic import field_validator

from refitplane.errors import FailedPrecondition
from refitplane.protocol.settings import ClientSettings


class AgentSettings(ClientSettings):
    # No localhost default: an agent that was not told where its coordinator is says so.
    coordinator: str = ""
    # Generator ranks and sidecars: the replica they belong to.
    replica_id: str = ""
    # The address peers reach this rank at (empty: the host's own address).
    host: str = ""
    # The physical machine this rank runs on (empty: the host name; in a pod set it from
    # spec.nodeName): ranks of one node may use CUDA IPC.
    node: str = ""
    # Trainer ranks: where the delta base lives, "device" or "host".
    delta_snapshot: str = "device"
    # vLLM engines: layer classes sent to the fail-safe path on purpose (comma-separated).
    fallback_layers: str = ""
    # vLLM replicas put to sleep between refits (colocated with the trainer): the level the
    # caller uses, 1 (weights kept in host memory) or 2 (weights dropped: a refit after it
    # always sends them in full); 0: never asleep (docs/generator.md#sleep-mode).
    sleep_level: int = 0
    # vLLM engines: the start-up check of the fast-path rules (vllm_rule_check). Layer
    # classes not checked (only classes a test pins), and the host memory one checked layer
    # may use.
    rule_check_skip: str = ""
    rule_check_max_bytes: int = 16 << 30
    # vLLM engines serving a speculative-decoding draft: "keep" it as loaded or "refit" it
    # with the target (init_info.draft wins; docs/vllm-integration.md, Draft models).
    draft: str = "keep"

    @field_validator("sleep_level")
    @classmethod
    def _sleep_level(cls, value: int) -> int:
        if value not in (0, 1, 2):
            raise ValueError(f"REFIT_SLEEP_LEVEL must be 0, 1 or 2, got {value}")
        return value

    @field_validator("draft")
    @classmethod
    def _draft(cls, value: str) -> str:
        if value not in ("keep", "refit"):
            raise ValueError(f"REFIT_DRAFT must be keep or refit, got {value!r}")
        return value

    def fallback_layer_names(self) -> list[str]:
        return _names(self.fallback_layers)

    def rule_check_skip_names(self) -> list[str]:
        return _names(self.rule_check_skip)

    def token(self) -> str | None:
        """The bearer token: REFIT_AUTH_TOKEN_FILE's content (a mounted Secret) wins over
        REFIT_AUTH_TOKEN. An unreadable file is an error, never a silent fall-back to
        running without the token it holds."""
        try:
            return super().token()
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot read REFIT_AUTH_TOKEN_FILE {self.auth_token_file}: {exc.strerror or exc}",
                field="auth_token_file",
            ) from None

    def tls_ca(self) -> str | None:
        return str(self.tls_ca_file) if self.tls_ca_file is not None else None

    def require(self, *, coordinator: str | None = None, job: str | None = None) -> tuple[str, str]:
        """The coordinator and job an agent registers with: the arguments, else the
        environment; a clear error naming the variable when neither has one."""
        coordinator = coordinator or self.coordinator
        job = job or self.job
        if not coordinator:
            raise FailedPrecondition(
                "no coordinator address: pass coordinator= or set REFIT_COORDINATOR",
                field="coordinator",
            )
        if not job:
            raise FailedPrecondition("no job name: pass job= or set REFIT_JOB", field="job")
        return coordinator, job


def _names(value: str) -> list[str]:
    """A comma-separated list of names."""
    return [name.strip() for name in value.split(",") if name.strip()]
