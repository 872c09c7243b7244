"""The only protobuf ⇄ Python converters of `refit.v1`, one module per kind of message:

    enums      Role, MemberState, RefitState, Backend
    reshard    boxes, tensor specs, layouts, rank plans, transfer config (`refitplane.reshard`)
    messages   registration, commands, reports (`refitplane.protocol.messages`)
    models     refits, topology (`refitplane.protocol.models`)

Protobuf stays at the edge: the coordinator's transports and the agent session / clients
convert here on arrival and departure, and nothing above them sees a generated type.
Conversions *from* protobuf validate, naming the request path of the field at fault.
"""

from refitplane.protocol.convert.enums import (
    backend_from_proto,
    backend_to_proto,
    member_state_from_proto,
    member_state_to_proto,
    refit_state_from_proto,
    refit_state_to_proto,
    role_from_proto,
    role_to_proto,
)
from refitplane.protocol.convert.messages import (
    command_from_proto,
    command_to_proto,
    register_from_proto,
    register_to_proto,
    report_from_proto,
    report_to_proto,
)
from refitplane.protocol.convert.models import (
    refit_from_proto,
    refit_to_proto,
    topology_from_proto,
    topology_to_proto,
)
from refitplane.protocol.convert.reshard import (
    box_from_proto,
    box_to_proto,
    config_from_proto,
    config_to_proto,
    layout_chunks,
    layout_from_proto,
    layout_to_proto,
    rank_plan_from_proto,
    rank_plan_to_proto,
    spec_from_proto,
    spec_to_proto,
)

__all__ = [
    "backend_from_proto",
    "backend_to_proto",
    "box_from_proto",
    "box_to_proto",
    "command_from_proto",
    "command_to_proto",
    "config_from_proto",
    "config_to_proto",
    "layout_chunks",
    "layout_from_proto",
    "layout_to_proto",
    "member_state_from_proto",
    "member_state_to_proto",
    "rank_plan_from_proto",
    "rank_plan_to_proto",
    "refit_from_proto",
    "refit_state_from_proto",
    "refit_state_to_proto",
    "refit_to_proto",
    "register_from_proto",
    "register_to_proto",
    "report_from_proto",
    "report_to_proto",
    "role_from_proto",
    "role_to_proto",
    "spec_from_proto",
    "spec_to_proto",
    "topology_from_proto",
    "topology_to_proto",
]
