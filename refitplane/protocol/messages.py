"""The agent protocol as frozen dataclasses: who a member is, the commands it receives and the
reports it sends. Shared by the agent session and the coordinator;
`refitplane.protocol.convert.messages` maps them to and from `refit.v1` protobuf at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from refitplane.protocol.enums import Backend, Role
from refitplane.protocol.models import fully_verified
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.plan import RankPlan


@dataclass(frozen=True)
class MemberInfo:
    """Who a member is. Members are keyed by (job, role, replica_id, rank)."""

    job: str
    role: Role
    rank: int = 0
    world_size: int = 1
    # Generators and sidecars: which replica. Trainers: empty.
    replica_id: str = ""
    host: str = ""
    # "cpu", "cuda" or "cuda:N"; sidecars may leave it empty.
    device: str = "cpu"
    labels: Mapping[str, str] = field(default_factory=dict)
    # Generators/sidecars coming back after a restart: the version they fully hold.
    version: int = 0
    # Generators: the rank's registered views are its live weights, kept between refits,
    # so a delta can be applied to them in place.
    delta_receive: bool = False
    # The physical machine (REFIT_NODE) and the GPU's UUID: which links may use CUDA IPC.
    node: str = ""
    device_uuid: str = ""


# --- commands (coordinator → member) -----------------------------------------------------


@dataclass(frozen=True)
class CreateRendezvousCmd:
    """To group rank 0: create the rendezvous of a new group epoch, then report it."""

    epoch: int
    backend: Backend
    group_size: int
    num_channels: int


@dataclass(frozen=True)
class JoinGroupCmd:
    """To every data-plane member of the group: build the communicator(s) of `epoch`."""

    epoch: int
    backend: Backend
    group_rank: int
    group_size: int
    num_channels: int
    rendezvous: bytes
    timeout_s: float


@dataclass(frozen=True)
class LeaveGroupCmd:
    """Tear down the communicator(s) of `epoch` (`abort`: do not wait for peers)."""

    epoch: int
    abort: bool


@dataclass(frozen=True)
class PrepareRefitCmd:
    """Get ready for a refit. Data-plane ranks get their plan (by `plan_digest` and
    `plan_rank`; the body in `plan` only when the coordinator does not know them to hold it)
    and the transfer config; sidecars get the pause mode instead. Answer with a Prepared
    report, or PlanMissing when the named plan is neither sent nor held."""

    refit_id: str
    version: int
    epoch: int
    plan: RankPlan | None = None
    config: TransferConfig | None = None
    pause_mode: str = ""
    plan_digest: str = ""
    plan_rank: int = 0
    # Group ranks on the other side of this rank's links that exchange a delta against
    # `delta_base_version` (empty: every link in full).
    delta_peers: frozenset[int] = frozenset()
    delta_base_version: int = 0

    @property
    def plan_key(self) -> tuple[str, int]:
        """What names the rank's plan: (plan digest, group rank)."""
        return self.plan_digest, self.plan_rank


@dataclass(frozen=True)
class StartTransferCmd:
    refit_id: str
    version: int
    # Sidecars: RanksVerified will come (False from a coordinator that predates it).
    ranks_verified: bool = False


@dataclass(frozen=True)
class AbortRefitCmd:
    refit_id: str
    reason: str
    message: str


# The label (value "push") with which a sidecar registers that it waits for RanksVerified:
# the coordinator sends the command, and says so in StartTransfer, only to those (a sidecar
# from before it polls the refit, and its session could not decode the command).
RANKS_VERIFIED_LABEL = "ranks_verified"


@dataclass(frozen=True)
class RanksVerifiedCmd:
    """To a target replica's sidecar, once per refit: the coordinator accepted a verified
    TransferDone from every rank of its replica (`member_ids`). Sent only while the refit has
    not failed: on the sidecar's stream it precedes any AbortRefit of the same refit."""

    refit_id: str
    version: int
    member_ids: frozenset[str] = frozenset()


CommandBody = (
    CreateRendezvousCmd
    | JoinGroupCmd
    | LeaveGroupCmd
    | PrepareRefitCmd
    | StartTransferCmd
    | AbortRefitCmd
    | RanksVerifiedCmd
)


@dataclass(frozen=True)
class Command:
    """One command on a member's stream; `seq` increases by one per member stream."""

    seq: int
    body: CommandBody


# --- reports (member → coordinator) ------------------------------------------------------


@dataclass(frozen=True)
class RendezvousReady:
    epoch: int
    rendezvous: bytes


@dataclass(frozen=True)
class GroupJoined:
    epoch: int


@dataclass(frozen=True)
class Prepared:
    pass


@dataclass(frozen=True)
class Progress:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_total: int = 0


@dataclass(frozen=True)
class HopStamps:
    """Where one rank's part of TRANSFERRING went (issue 23), its wall clock
    (`time.time_ns()`; 0: not stamped): StartTransfer seen, its executor's start and end,
    TransferDone sent. A clock read each, nothing more on the hot path."""

    start_seen_ns: int = 0
    executor_start_ns: int = 0
    executor_end_ns: int = 0
    sent_ns: int = 0


@dataclass(frozen=True)
class TransferDone:
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    # Receivers: tensors whose every piece matched the sender's checksum.
    tensors_verified: int = 0
    tensors_total: int = 0
    # Senders: the bytes a full refit would have sent, and the version whose bytes the rank
    # now keeps as its delta base (0: none).
    bytes_full: int = 0
    delta_base_version: int = 0
    # The rank's hop timeline (issue 23, `HopStamps`): 0 where not stamped.
    hops: HopStamps = field(default_factory=HopStamps)

    @property
    def fully_verified(self) -> bool:
        return fully_verified(self.tensors_verified, self.tensors_total)


@dataclass(frozen=True)
class ReplicaUpdated:
    version: int


@dataclass(frozen=True)
class PlanMissing:
    """A PrepareRefit named a plan this rank does not hold: send it again with the body."""

    plan_digest: str
    plan_rank: int
    message: str = ""


@dataclass(frozen=True)
class Failure:
    # Machine-readable (TIMEOUT, PEER_FAILED, CHECKSUM_MISMATCH, INVALID_LAYOUT, ...).
    reason: str
    message: str
    # True when some destination bytes were already overwritten: the replica must not serve.
    weights_modified: bool = False
    # Set for failures of group commands (rendezvous, join), which belong to no refit.
    epoch: int = 0


ReportBody = (
    RendezvousReady
    | GroupJoined
    | Prepared
    | Progress
    | TransferDone
    | ReplicaUpdated
    | Failure
    | PlanMissing
)


@dataclass(frozen=True)
class Report:
    member_id: str
    refit_id: str
    body: ReportBody
