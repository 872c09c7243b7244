"""Input checks shared by every entry point; each error names the field at fault."""

from __future__ import annotations

import re

from refitplane.coordinator.store.base import MAX_VERSION
from refitplane.errors import InvalidArgument
from refitplane.protocol import Role
from refitplane.protocol.messages import MemberInfo

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DEVICE = re.compile(r"cpu|cuda(:\d{1,4})?")
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")
MAX_WORLD_SIZE = 1 << 20
MAX_LABELS = 64
MAX_KEY_LEN = 256
MAX_ID_LEN = 128


def _short(value: str, limit: int = 40) -> str:
    """A value quoted for an error message, cut so a hostile input cannot flood logs."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


def check_name(value: str, field: str) -> str:
    if not _NAME.fullmatch(value):
        raise InvalidArgument(
            f"{field} {_short(value)} must be 1-128 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit",
            field=field,
        )
    return value


def check_version(value: int, field: str = "version") -> int:
    if value < 0 or value > MAX_VERSION:
        raise InvalidArgument(f"{field} must be 0..{MAX_VERSION}, got {value}", field=field)
    return value


def check_refit_id(value: str) -> str:
    if not value or len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"refit_id must be 1-{MAX_ID_LEN} characters", field="refit_id")
    return value


def check_member_id(value: str) -> str:
    if not value or len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"member_id must be 1-{MAX_ID_LEN} characters", field="member_id")
    return value


def check_idempotency_key(value: str) -> str:
    if len(value) > MAX_KEY_LEN or any(ord(c) < 32 for c in value):
        raise InvalidArgument(
            f"idempotency_key must be at most {MAX_KEY_LEN} printable characters",
            field="idempotency_key",
        )
    return value


def check_targets(values: list[str]) -> list[str]:
    for i, replica in enumerate(values):
        check_name(replica, f"target_replicas[{i}]")
    # A replica listed twice is still one replica.
    return sorted(set(values))


def check_member(info: MemberInfo) -> MemberInfo:
    """A registration's fields: names, rank within world size, device, labels."""
    check_name(info.job, "job")
    if info.role is Role.TRAINER:
        if info.replica_id:
            raise InvalidArgument("trainers register without a replica_id", field="replica_id")
    else:
        check_name(info.replica_id, "replica_id")
    if info.world_size < 1 or info.world_size > MAX_WORLD_SIZE:
        raise InvalidArgument(
            f"world_size must be 1..{MAX_WORLD_SIZE}, got {info.world_size}", field="world_size"
        )
    if info.rank >= info.world_size:
        raise InvalidArgument(
            f"rank {info.rank} is not below world_size {info.world_size}", field="rank"
        )
    if info.role is Role.GENERATOR_SIDECAR and info.rank != 0:
        raise InvalidArgument("a sidecar registers with rank 0 (one per replica)", field="rank")
    for name, value in (("host", info.host), ("node", info.node)):
        if len(value) > 255:
            raise InvalidArgument(f"{name} is longer than 255 characters", field=name)
    if len(info.device_uuid) > 64 or any(ord(c) < 33 for c in info.device_uuid):
        raise InvalidArgument(
            f"device_uuid {_short(info.device_uuid)} must be at most 64 printable characters",
            field="device_uuid",
        )
    if info.role.is_data_plane and not _DEVICE.fullmatch(info.device):
        raise InvalidArgument(
            f"device {_short(info.device)} must be 'cpu', 'cuda' or 'cuda:N'", field="device"
        )
    if len(info.labels) > MAX_LABELS:
        raise InvalidArgument(f"more than {MAX_LABELS} labels", field="labels")
    for key, value in info.labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise InvalidArgument(f"label key {_short(key)} is not a valid key", field="labels")
        if len(value) > 256:
            raise InvalidArgument(f"label {key!r} is longer than 256 characters", field="labels")
    check_version(info.version)
    return info
