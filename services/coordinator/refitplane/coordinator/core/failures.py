"""Why refits fail: machine-readable reasons (stable API) and the exception that carries one
through the state machine."""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # Membership
    LEASE_EXPIRED = "LEASE_EXPIRED"
    MEMBER_REPLACED = "MEMBER_REPLACED"
    MEMBER_LEFT = "MEMBER_LEFT"
    MEMBERS_MISSING = "MEMBERS_MISSING"
    LAYOUT_MISSING = "LAYOUT_MISSING"
    NO_TARGETS = "NO_TARGETS"
    INVALID_TOPOLOGY = "INVALID_TOPOLOGY"
    # Layouts (the planner's LayoutError / CoverageError reasons)
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
    # The store came back without the state this coordinator wrote (see core/lost_state.py).
    STORE_STATE_LOST = "STORE_STATE_LOST"
    INTERNAL = "INTERNAL"


class RefitFailed(Exception):
    """Ends the refit being driven. `reason` is a `Reason` or a reason an agent reported."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = str(reason)
        self.message = message


def list_some(items: list[str], limit: int = 8) -> str:
    """`a, b, c` — or the first `limit` and how many more, so messages stay readable."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
