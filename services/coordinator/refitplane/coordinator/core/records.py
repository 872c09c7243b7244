"""What the coordinator persists: members, refits, groups, replicas and job pointers.

Pydantic models serialised as JSON by both stores. Refit records carry internal fields
(participants, per-replica outcomes) that the public `Refit` view leaves out.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from refitplane.protocol import Backend, MemberState, RefitState, Role
from refitplane.protocol.models import PhaseTiming, RankProgress, Refit

_RECORD = ConfigDict(frozen=True, extra="ignore")


def _empty_tables_as_lists(data: Any, fields: tuple[str, ...]) -> Any:
    """Redis' Lua cjson encodes an empty array as `{}`; read it back as a list."""
    if isinstance(data, dict):
        for name in fields:
            if data.get(name) == {}:
                data[name] = []
    return data


class MemberRecord(BaseModel):
    model_config = _RECORD

    member_id: str
    job: str
    role: Role
    replica_id: str = ""
    rank: int = 0
    world_size: int = 1
    host: str = ""
    device: str = ""
    # The physical machine and the GPU's UUID: which links may use CUDA IPC.
    node: str = ""
    device_uuid: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    # Generators and sidecars: the version this member fully holds.
    version: int = 0
    # Generators: can apply a delta in place (its registered views are its live weights).
    delta_receive: bool = False
    layout_digest: str = ""
    # Stored states are JOINING, READY and LOST; BUSY and DEGRADED are derived for views.
    state: MemberState = MemberState.JOINING
    registered_unix: float = 0.0
    lease_expires_unix: float = 0.0
    # SHA-256 of the credential issued at registration (never the credential itself; never
    # in a view): every agent call naming this member must present the credential.
    credential_sha256: str = ""

    @property
    def key(self) -> str:
        """Members are unique per (job, role, replica, rank); re-registering replaces."""
        return f"{self.role.value}/{self.replica_id}/{self.rank}"

    @property
    def alive(self) -> bool:
        return self.state is not MemberState.LOST

    def describe(self) -> str:
        """How errors name a member: role, replica, rank and id."""
        where = f"replica {self.replica_id!r} " if self.replica_id else ""
        return f"{self.role.value.lower()} {where}rank {self.rank} (member {self.member_id})"


class RefitRecord(BaseModel):
    model_config = _RECORD

    refit_id: str
    job: str
    version: int
    state: RefitState = RefitState.PENDING
    target_replicas: list[str] = Field(default_factory=list)
    idempotency_key: str = ""
    reason: str = ""
    message: str = ""
    created_unix: float = 0.0
    updated_unix: float = 0.0
    bytes_total: int = 0
    bytes_done: int = 0
    timings: dict[RefitState, float] = Field(default_factory=dict)
    ranks: dict[str, RankProgress] = Field(default_factory=dict)
    plan_digest: str = ""
    group_epoch: int = 0
    coalesced: int = 0
    tensors_verified: int = 0
    tensors_total: int = 0
    bytes_on_wire: int = 0
    delta_replicas: list[str] = Field(default_factory=list)
    # The coordinator's ends of the hop timeline (`Refit.start_sent_ns`, `transfer_end_ns`).
    start_sent_ns: int = 0
    transfer_end_ns: int = 0
    # --- internal -------------------------------------------------------------------------
    # Every member that was sent a command for this refit (aborts go to them after a restart).
    participants: list[str] = Field(default_factory=list)
    # Target replicas that finished (their version is the refit's) or were degraded.
    replicas_done: list[str] = Field(default_factory=list)
    replicas_degraded: list[str] = Field(default_factory=list)
    phase_started_unix: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: Any) -> Any:
        return _empty_tables_as_lists(
            data,
            (
                "target_replicas",
                "participants",
                "replicas_done",
                "replicas_degraded",
                "delta_replicas",
            ),
        )

    def view(self) -> Refit:
        return Refit(
            refit_id=self.refit_id,
            job=self.job,
            version=self.version,
            state=self.state,
            target_replicas=list(self.target_replicas),
            idempotency_key=self.idempotency_key,
            reason=self.reason,
            message=self.message,
            created_unix=self.created_unix,
            updated_unix=self.updated_unix,
            bytes_total=self.bytes_total,
            bytes_done=self.bytes_done,
            timings=[PhaseTiming(phase=p, seconds=s) for p, s in self.timings.items()],
            ranks=[self.ranks[k] for k in sorted(self.ranks)],
            plan_digest=self.plan_digest,
            group_epoch=self.group_epoch,
            coalesced=self.coalesced,
            tensors_verified=self.tensors_verified,
            tensors_total=self.tensors_total,
            bytes_on_wire=self.bytes_on_wire,
            delta_replicas=list(self.delta_replicas),
            start_sent_ns=self.start_sent_ns,
            transfer_end_ns=self.transfer_end_ns,
        )


class GroupState(enum.StrEnum):
    NONE = "NONE"
    # Rendezvous handed out, waiting for members to join.
    FORMING = "FORMING"
    READY = "READY"
    # A refit failed on it (or it failed to form): the next refit starts a new epoch.
    POISONED = "POISONED"


class GroupRecord(BaseModel):
    """One communication-group epoch: members in group-rank order."""

    model_config = _RECORD

    job: str
    epoch: int = 0
    state: GroupState = GroupState.NONE
    backend: Backend | None = None
    members: list[str] = Field(default_factory=list)
    num_channels: int = 0

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: Any) -> Any:
        return _empty_tables_as_lists(data, ("members",))

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int:
        try:
            return self.members.index(member_id)
        except ValueError:
            return -1


class ReplicaRecord(BaseModel):
    model_config = _RECORD

    replica_id: str
    # Weights incomplete after a failed refit: not serving until a refit commits on it.
    degraded: bool = False
    # Degraded because a coordinator died while its refit was past StartTransfer: nobody
    # knows what the ranks hold until they report it (RenewLease.held), which then decides.
    unverified: bool = False


class JobRecord(BaseModel):
    """A job's durable pointers and versions, as one read."""

    model_config = _RECORD

    job: str
    active: str = ""
    pending: str = ""
    # Highest version ever handed out (triggers must go above it).
    last_version: int = 0
    committed_version: int = 0
    group: GroupRecord
    replicas: dict[str, ReplicaRecord] = Field(default_factory=dict)


class PlanInfo(BaseModel):
    """What the store remembers of a plan (the plan itself is rebuilt from the layouts)."""

    model_config = _RECORD

    key: str
    plan_digest: str
    source_digest: str
    target_digest: str
    total_bytes: int
    num_links: int
    num_tensors: int
    created_unix: float


class TriggerOutcome(enum.StrEnum):
    CREATED = "created"
    COALESCED = "coalesced"
    EXISTING = "existing"


class TriggerRequest(BaseModel):
    model_config = _RECORD

    job: str
    version: int
    target_replicas: list[str]
    idempotency_key: str
    now: float
    new_id: str
    # How long an idempotency key is remembered.
    key_ttl_s: int = 7 * 24 * 3600


class TriggerResult(BaseModel):
    model_config = _RECORD

    refit: RefitRecord
    outcome: TriggerOutcome
