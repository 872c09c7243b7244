"""The wire vocabulary of `refit.v1`, at the bottom of the house: what every role says to the
coordinator and what it answers, as plain Python.

    enums      Role, MemberState, RefitState, Backend
    messages   MemberInfo, the commands a member receives, the reports it sends (agent.proto)
    models     Refit, Topology, Member, Replica, PhaseTiming, RankProgress (orchestrator-facing,
               pydantic: REST bodies and client results)
    convert    the only protobuf ⇄ Python converters (`from refitplane.protocol import convert`)
    channel    gRPC channels to the coordinator; status codes and trailers ⇄ `refitplane.errors`
    settings   where clients and agents find the coordinator (REFIT_*)
    Reason     the one list of failure reasons (defined in `refitplane.reasons`, beside
               `refitplane.errors`, whose classes it types; re-exported here)

The coordinator, the agent runtime, the clients and the CLI all import this package and
none of them imports another's for vocabulary. Below it sit only `refitplane.errors`,
`refitplane.reshard` (layouts, plans, transfer config: the tensor side) and the generated
stubs. This module re-exports the vocabulary (enums, messages, models).
"""

from refitplane.protocol.enums import Backend, MemberState, RefitState, Role
from refitplane.protocol.messages import (
    AbortRefitCmd,
    Command,
    CommandBody,
    CreateRendezvousCmd,
    Failure,
    GroupJoined,
    JoinGroupCmd,
    LeaveGroupCmd,
    MemberInfo,
    PlanMissing,
    Prepared,
    PrepareRefitCmd,
    Progress,
    RanksVerifiedCmd,
    RendezvousReady,
    ReplicaUpdated,
    Report,
    ReportBody,
    StartTransferCmd,
    TransferDone,
)
from refitplane.protocol.models import Member, PhaseTiming, RankProgress, Refit, Replica, Topology
from refitplane.reasons import Reason

__all__ = [
    "AbortRefitCmd",
    "Backend",
    "Command",
    "CommandBody",
    "CreateRendezvousCmd",
    "Failure",
    "GroupJoined",
    "JoinGroupCmd",
    "LeaveGroupCmd",
    "Member",
    "MemberInfo",
    "MemberState",
    "PhaseTiming",
    "PlanMissing",
    "PrepareRefitCmd",
    "Prepared",
    "Progress",
    "RankProgress",
    "RanksVerifiedCmd",
    "Reason",
    "Refit",
    "RefitState",
    "RendezvousReady",
    "Replica",
    "ReplicaUpdated",
    "Report",
    "ReportBody",
    "Role",
    "StartTransferCmd",
    "Topology",
    "TransferDone",
]
