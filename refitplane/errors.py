"""Domain errors shared by every component.

Each error carries a machine-readable `reason` and, where one is at fault, the field,
tensor, rank or box. Transports (gRPC, REST, CLI) translate them at the boundary, in one
place each; nothing below the boundary knows about status codes.
"""

from __future__ import annotations

from refitplane.reasons import Reason


class RefitError(Exception):
    """Base class. `reason` is stable and machine-readable (a `Reason`; a plain string only
    when it came from a peer that knows reasons this one does not); the message is for
    humans."""

    reason: str = Reason.INTERNAL

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgument(RefitError):
    reason: str = Reason.INVALID_ARGUMENT


class LayoutError(InvalidArgument):
    """A layout is malformed or the two sides disagree. Names the tensor, rank and box."""

    reason: str = Reason.INVALID_LAYOUT

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

    reason: str = Reason.UNCOVERED


class NotFound(RefitError):
    reason: str = Reason.NOT_FOUND


class Conflict(RefitError):
    reason: str = Reason.CONFLICT


class FailedPrecondition(RefitError):
    reason: str = Reason.FAILED_PRECONDITION


class Unauthenticated(RefitError):
    reason: str = Reason.UNAUTHENTICATED


class PermissionDenied(RefitError):
    """Authenticated, but not as the member the call names (a wrong member credential)."""

    reason: str = Reason.PERMISSION_DENIED


class RateLimited(RefitError):
    reason: str = Reason.RATE_LIMITED


class Unavailable(RefitError):
    reason: str = Reason.UNAVAILABLE


class TransferError(RefitError):
    """The data plane failed; the refit must be aborted and the group rebuilt."""

    reason: str = Reason.TRANSFER_FAILED


class TransferTimeout(TransferError):
    reason: str = Reason.TIMEOUT


class PeerFailure(TransferError):
    reason: str = Reason.PEER_FAILED


class ChecksumMismatch(TransferError):
    reason: str = Reason.CHECKSUM_MISMATCH
