"""The enums of `refit.v1`: roles, member/refit states and backends as Python enums.

Everything above the wire (the coordinator's core, the agent session, the client) speaks these
enums; only the converters at the edge (`refitplane.protocol.convert`) touch the generated
protobuf enums. Values are the proto names without their prefix, which is
also how they appear in REST/JSON.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from refitplane.errors import InvalidArgument

_E = TypeVar("_E", bound="_ProtoEnum")


class _ProtoEnum(enum.Enum):
    """An enum mirrored by a proto enum whose value names are `<PREFIX>_<member value>`."""

    @classmethod
    def _prefix(cls) -> str:
        raise NotImplementedError

    @classmethod
    def from_proto(cls: type[_E], number: int, names: dict[int, str], *, field: str) -> _E:
        """Map a proto enum number; UNSPECIFIED and unknown numbers name the field at fault."""
        name = names.get(number)
        prefix = cls._prefix()
        if name is None or not name.startswith(prefix):
            raise InvalidArgument(f"{field}: unknown value {number}", field=field)
        try:
            return cls(name.removeprefix(prefix))
        except ValueError:
            raise InvalidArgument(f"{field} must be set (got {name})", field=field) from None

    def proto_name(self) -> str:
        return f"{self._prefix()}{self.value}"


class Role(_ProtoEnum):
    TRAINER = "TRAINER"
    GENERATOR = "GENERATOR"
    GENERATOR_SIDECAR = "GENERATOR_SIDECAR"

    @classmethod
    def _prefix(cls) -> str:
        return "ROLE_"

    @property
    def is_data_plane(self) -> bool:
        """Trainer and generator ranks move bytes; sidecars only drive their engine."""
        return self is not Role.GENERATOR_SIDECAR


class MemberState(_ProtoEnum):
    JOINING = "JOINING"
    READY = "READY"
    BUSY = "BUSY"
    LOST = "LOST"
    DEGRADED = "DEGRADED"

    @classmethod
    def _prefix(cls) -> str:
        return "MEMBER_STATE_"


class RefitState(_ProtoEnum):
    PENDING = "PENDING"
    PREPARING = "PREPARING"
    TRANSFERRING = "TRANSFERRING"
    VERIFYING = "VERIFYING"
    COMMITTED = "COMMITTED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @classmethod
    def _prefix(cls) -> str:
        return "REFIT_STATE_"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def in_flight(self) -> bool:
        """Past PENDING and not finished: participants hold commands for this refit."""
        return self in _IN_FLIGHT


_TERMINAL = frozenset({RefitState.COMMITTED, RefitState.FAILED, RefitState.CANCELLED})
_IN_FLIGHT = frozenset({RefitState.PREPARING, RefitState.TRANSFERRING, RefitState.VERIFYING})


class Backend(_ProtoEnum):
    GLOO = "GLOO"
    NCCL = "NCCL"
    CUDA_IPC = "CUDA_IPC"

    @classmethod
    def _prefix(cls) -> str:
        return "BACKEND_"
