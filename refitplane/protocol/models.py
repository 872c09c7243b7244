"""What orchestrators see: refit records and job topology as frozen pydantic models.

The same models are the coordinator's REST API's JSON bodies and the typed client's return
values (re-exported by `refitplane.client`), so the two transports cannot disagree. Enum values are the proto names without their prefix
(`"COMMITTED"`, `"GENERATOR"`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from refitplane.protocol.enums import Backend, MemberState, RefitState, Role

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class PhaseTiming(BaseModel):
    model_config = _FROZEN

    phase: RefitState
    seconds: float


def fully_verified(tensors_verified: int, tensors_total: int) -> bool:
    """A receiver's report vouches for its share: it received tensors and every one matched
    its sender's checksum. The one rule for "this rank verified" — the coordinator's
    RanksVerified push and a controller reading the record both apply it."""
    return 0 < tensors_total == tensors_verified


class RankProgress(BaseModel):
    """Bytes one participant moved in one refit (and, for receivers, tensors verified)."""

    model_config = _FROZEN

    member_id: str
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_total: int = 0
    tensors_verified: int = 0
    tensors_total: int = 0
    # The hop timeline of a data-plane rank (issue 23), wall clock (`time.time_ns()`; 0:
    # not stamped): when its StartTransfer reached it, when its executor started and ended,
    # and when it sent TransferDone (its clock), and when the coordinator accepted that
    # report (the coordinator's clock). Comparable only where every clock is one host's.
    start_seen_ns: int = 0
    executor_start_ns: int = 0
    executor_end_ns: int = 0
    done_sent_ns: int = 0
    done_recorded_ns: int = 0

    @property
    def fully_verified(self) -> bool:
        return fully_verified(self.tensors_verified, self.tensors_total)


class Refit(BaseModel):
    """One refit of a job's generators to a weight version."""

    model_config = _FROZEN

    refit_id: str
    job: str
    version: int
    state: RefitState
    # Replicas being updated; empty at trigger time means all (filled in at PREPARING).
    target_replicas: list[str] = Field(default_factory=list)
    idempotency_key: str = ""
    # Machine-readable failure reason (TIMEOUT, PEER_FAILED, UNCOVERED, LEASE_EXPIRED, ...).
    reason: str = ""
    message: str = ""
    created_unix: float = 0.0
    updated_unix: float = 0.0
    bytes_total: int = 0
    bytes_done: int = 0
    timings: list[PhaseTiming] = Field(default_factory=list)
    ranks: list[RankProgress] = Field(default_factory=list)
    plan_digest: str = ""
    group_epoch: int = 0
    # Triggers coalesced into this refit while another one was running.
    coalesced: int = 0
    tensors_verified: int = 0
    tensors_total: int = 0
    # Bytes the senders put on the wire (below bytes_done when replicas took a delta).
    bytes_on_wire: int = 0
    # Replicas that received a delta against the version they held; the rest, in full.
    delta_replicas: list[str] = Field(default_factory=list)
    # The coordinator's ends of the hop timeline (`time.time_ns()`, 0: not reached): when it
    # sent StartTransfer, and when TRANSFERRING ended (every data-plane rank's TransferDone
    # accepted); each rank's part is in `ranks`.
    start_sent_ns: int = 0
    transfer_end_ns: int = 0

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def fraction_done(self) -> float:
        """Bytes moved / bytes planned (0 before the plan is known)."""
        return self.bytes_done / self.bytes_total if self.bytes_total else 0.0


class Member(BaseModel):
    model_config = _FROZEN

    member_id: str
    job: str
    role: Role
    replica_id: str = ""
    rank: int = 0
    world_size: int = 1
    host: str = ""
    device: str = ""
    state: MemberState
    # Group rank in the current epoch; -1 when not in a group.
    group_rank: int = -1
    layout_digest: str = ""
    # Generators and sidecars: the weight version this member fully holds.
    version: int = 0
    lease_expires_unix: float = 0.0
    labels: dict[str, str] = Field(default_factory=dict)
    # The physical machine and the GPU's UUID (empty on CPU or when not told).
    node: str = ""
    device_uuid: str = ""


class Replica(BaseModel):
    model_config = _FROZEN

    replica_id: str
    version: int
    state: MemberState
    world_size: int
    member_ids: list[str] = Field(default_factory=list)


class Topology(BaseModel):
    """Who is in a job, what each replica serves, and the current communication group."""

    model_config = _FROZEN

    job: str
    members: list[Member] = Field(default_factory=list)
    replicas: list[Replica] = Field(default_factory=list)
    group_epoch: int = 0
    group_size: int = 0
    # None while no group has been formed.
    backend: Backend | None = None
    committed_version: int = 0
    source_layout_digest: str = ""
    target_layout_digest: str = ""
    healthy: bool = False
