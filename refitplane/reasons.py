"""The one list of failure reasons: the stable, machine-readable values of `Refit.reason`, of
an agent's `Failure.reason`, of `AbortRefit.reason` and of every `RefitError.reason`
(also sent as the `refit-reason` trailer of a failed call).

Public as `refitplane.protocol.Reason` and `refitplane.client.Reason`, for clients to compare
against (`refit.reason == Reason.TIMEOUT`; a `StrEnum`, so it equals its string). It sits at
the bottom of the house, beside `refitplane.errors`, so that the error classes are typed
with it too. A reason this list lacks can still arrive from a newer peer: fields that carry
one stay `str`.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # Calls (RefitError: the gRPC / HTTP status follows from the class)
    INTERNAL = "INTERNAL"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    CONFLICT = "CONFLICT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    # A member credential that is not the caller's own
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RATE_LIMITED = "RATE_LIMITED"
    UNAVAILABLE = "UNAVAILABLE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    # A command-line flag or argument refitctl refused (exit status 2)
    USAGE = "USAGE"
    # Membership
    LEASE_EXPIRED = "LEASE_EXPIRED"
    MEMBER_REPLACED = "MEMBER_REPLACED"
    MEMBER_LEFT = "MEMBER_LEFT"
    MEMBERS_MISSING = "MEMBERS_MISSING"
    LAYOUT_MISSING = "LAYOUT_MISSING"
    NO_TARGETS = "NO_TARGETS"
    INVALID_TOPOLOGY = "INVALID_TOPOLOGY"
    # Layouts (the planner's LayoutError / CoverageError)
    INVALID_LAYOUT = "INVALID_LAYOUT"
    UNCOVERED = "UNCOVERED"
    # Group epochs
    GROUP_FAILED = "GROUP_FAILED"
    # Phases
    TIMEOUT = "TIMEOUT"
    PLAN_MISSING = "PLAN_MISSING"
    VERIFY_FAILED = "VERIFY_FAILED"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    # A rank's TransferDone contradicts what the plan gives it (tensors, bytes).
    REPORT_MISMATCH = "REPORT_MISMATCH"
    CANCELLED = "CANCELLED"
    COORDINATOR_RESTARTED = "COORDINATOR_RESTARTED"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    # The store came back without the state this coordinator wrote (core/lost_state.py).
    STORE_STATE_LOST = "STORE_STATE_LOST"
    # The data plane (TransferError and its kinds)
    TRANSFER_FAILED = "TRANSFER_FAILED"
    PEER_FAILED = "PEER_FAILED"
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    # An agent or a vLLM engine failed with something that is not a RefitError
    AGENT_ERROR = "AGENT_ERROR"
    ENGINE_ERROR = "ENGINE_ERROR"
    # An agent's Failure that named no reason
    UNKNOWN = "UNKNOWN"
