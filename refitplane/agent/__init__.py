"""The agent session runtime: how trainer ranks, generator ranks and generator sidecars talk
to the coordinator (register, renew the lease, publish a layout, run commands, report).

    session = AgentSession("coordinator:50051", MemberInfo(...), handler)
    session.start()
    session.publish_layout(shards.layout(rank))
    ...
    session.close()

Protobuf never crosses this package's public API: commands arrive as the frozen dataclasses
of `refitplane.protocol.messages` (re-exported here), layouts and plans as `refitplane.reshard`
types.
"""

from refitplane.agent.handler import CommandHandler, NullHandler
from refitplane.agent.session import AgentSession
from refitplane.protocol.messages import (
    AbortRefitCmd,
    Command,
    CreateRendezvousCmd,
    JoinGroupCmd,
    LeaveGroupCmd,
    MemberInfo,
    PrepareRefitCmd,
    RanksVerifiedCmd,
    StartTransferCmd,
)

__all__ = [
    "AbortRefitCmd",
    "AgentSession",
    "Command",
    "CommandHandler",
    "CreateRendezvousCmd",
    "JoinGroupCmd",
    "LeaveGroupCmd",
    "MemberInfo",
    "NullHandler",
    "PrepareRefitCmd",
    "RanksVerifiedCmd",
    "StartTransferCmd",
]
