"""What a trainer's refitplane weight-sync engine is told (`sync_settings`): any init info
whose backend is "refitplane", completed from the REFIT_* environment (`AgentSettings`), and
the run id the trainer ranks of one training run share.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from refitplane.agent.dataplane import local_address
from refitplane.agent.settings import AgentSettings
from refitplane.errors import InvalidArgument


@dataclass
class SyncSettings:
    """The engine's settings: the init info's fields, else REFIT_* (`sync_settings`)."""

    coordinator: str
    job: str
    replica_id: str
    world_size: int
    run_id: str
    generator_coordinator: str
    all_replicas: bool
    host: str
    timeout_s: float
    init_timeout_s: float
    token: str | None = None
    tls_ca: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


def sync_settings(info: Any, client: object, env: AgentSettings | None = None) -> SyncSettings:
    """Read any init info whose backend is "refitplane" (fields missing from it, e.g. when
    a team swapped only the backend name of another backend's init info, come from the
    agents' settings: `AgentSettings`, the REFIT_* environment)."""
    env = env or AgentSettings()

    def pick(name: str, default: Any = "") -> Any:
        value = getattr(info, name, None)
        return value if value not in (None, "", 0) else default

    coordinator = pick("coordinator") or env.coordinator
    job = pick("job") or env.job
    if not coordinator:
        raise InvalidArgument(
            "init_info.coordinator is required (or set REFIT_COORDINATOR)", field="coordinator"
        )
    if not job:
        raise InvalidArgument("init_info.job is required (or set REFIT_JOB)", field="job")
    world = int(pick("world_size", default=0))
    if world <= 0:
        world = _dist_world_size()
    return SyncSettings(
        coordinator=coordinator,
        job=job,
        replica_id=pick("replica_id") or env.replica_id or _default_replica(client),
        world_size=world,
        run_id=pick("run_id"),
        generator_coordinator=pick("generator_coordinator") or coordinator,
        all_replicas=bool(getattr(info, "all_replicas", False)),
        host=pick("host") or env.host or local_address(),
        timeout_s=float(pick("timeout_s", default=600.0)),
        init_timeout_s=float(pick("init_timeout_s", default=300.0)),
        token=env.token(),
        tls_ca=env.tls_ca(),
    )


def _dist_world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _default_replica(client: object) -> str:
    """A replica id every rank derives alike from the client it was given."""
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str) and base_url:
        return "vllm-" + hashlib.sha1(base_url.encode()).hexdigest()[:10]
    return "vllm-0"


def shared_run_id(settings: SyncSettings, rank: int) -> str:
    if settings.run_id:
        return settings.run_id
    if settings.world_size == 1:
        return uuid.uuid4().hex
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument(
            f"{settings.world_size} trainer ranks need a shared init_info.run_id (or an "
            "initialised torch.distributed default group to agree on one)",
            field="run_id",
        )
    # Every rank calls trainer_init (vLLM's contract), so this collective matches.
    box: list[object] = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])
