"""Domain errors shared by every component.

Each error carries a machine-readable `reason` and, where one is at fault, the field,
tensor, rank or box. Transports (gRPC, REST, CLI) translate them at the boundary, in one
place each; nothing below the boundary knows about status codes.
"""

from __future__ import annotations


class RefitError(Exception):
    """Base class. `reason` is stable and machine-readable; the message is for humans."""

    reason = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgument(RefitError):
    reason = "INVALID_ARGUMENT"


class LayoutError(InvalidArgument):
    """A layout is malformed or the two sides disagree. Names the tensor, rank and box."""

    reason = "INVALID_LAYOUT"

    def __init__(
        self,
        message: str,
        *,
        tensor: str | None = None,
        rank: int | None = None,
        box: str | None = None,
        field: str | None = None,
    ) -> None:
        where = []
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if rank is not None:
            where.append(f"rank {rank}")
        if box is not None:
            where.append(f"box {box}")
        full = f"{', '.join(where)}: {message}" if where else message
        super().__init__(full, field=field)
        self.detail = message
        self.tensor = tensor
        self.rank = rank
        self.box = box

    def with_rank(self, rank: int | None) -> LayoutError:
        """The same error naming another rank (e.g. mapped back from a group rank)."""
        return type(self)(
            self.detail, tensor=self.tensor, rank=rank, box=self.box, field=self.field
        )


class CoverageError(LayoutError):
    """A destination needs elements that no source holds."""

    reason = "UNCOVERED"


class NotFound(RefitError):
    reason = "NOT_FOUND"


class Conflict(RefitError):
    reason = "CONFLICT"


class FailedPrecondition(RefitError):
    reason = "FAILED_PRECONDITION"


class Unauthenticated(RefitError):
    reason = "UNAUTHENTICATED"


class PermissionDenied(RefitError):
    """Authenticated, but not as the member the call names (a wrong member credential)."""

    reason = "PERMISSION_DENIED"


class RateLimited(RefitError):
    reason = "RATE_LIMITED"


class Unavailable(RefitError):
    reason = "UNAVAILABLE"


class TransferError(RefitError):
    """The data plane failed; the refit must be aborted and the group rebuilt."""

    reason = "TRANSFER_FAILED"


class TransferTimeout(TransferError):
    reason = "TIMEOUT"


class PeerFailure(TransferError):
    reason = "PEER_FAILED"


class ChecksumMismatch(TransferError):
    reason = "CHECKSUM_MISMATCH"
