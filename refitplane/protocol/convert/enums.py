"""The `refit.v1` enums ↔ `refitplane.protocol.enums`.

Conversions from protobuf validate: UNSPECIFIED and unknown numbers raise `InvalidArgument`
naming the field at fault.
"""

from __future__ import annotations

from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.protocol.enums import Backend, MemberState, RefitState, Role

_ROLE_NAMES = {v.number: v.name for v in cpb.Role.DESCRIPTOR.values}
_BACKEND_NAMES = {v.number: v.name for v in cpb.Backend.DESCRIPTOR.values}
_MEMBER_STATE_NAMES = {v.number: v.name for v in cpb.MemberState.DESCRIPTOR.values}
_REFIT_STATE_NAMES = {v.number: v.name for v in cpb.RefitState.DESCRIPTOR.values}


def role_from_proto(number: int, *, field: str = "role") -> Role:
    return Role.from_proto(number, _ROLE_NAMES, field=field)


def role_to_proto(role: Role) -> cpb.Role.ValueType:
    return cpb.Role.Value(role.proto_name())


def backend_from_proto(number: int, *, field: str = "backend") -> Backend:
    return Backend.from_proto(number, _BACKEND_NAMES, field=field)


def backend_to_proto(backend: Backend) -> cpb.Backend.ValueType:
    return cpb.Backend.Value(backend.proto_name())


def member_state_from_proto(number: int, *, field: str = "state") -> MemberState:
    return MemberState.from_proto(number, _MEMBER_STATE_NAMES, field=field)


def member_state_to_proto(state: MemberState) -> cpb.MemberState.ValueType:
    return cpb.MemberState.Value(state.proto_name())


def refit_state_from_proto(number: int, *, field: str = "state") -> RefitState:
    return RefitState.from_proto(number, _REFIT_STATE_NAMES, field=field)


def refit_state_to_proto(state: RefitState) -> cpb.RefitState.ValueType:
    return cpb.RefitState.Value(state.proto_name())
