"""The exception that carries a refit's failure through the state machine; its reason is
one of `refitplane.protocol.Reason` (or, reported by an agent, the agent's string)."""

from __future__ import annotations

from refitplane.errors import RefitError
from refitplane.protocol import Reason


class RefitFailed(RefitError):
    """Ends the refit being driven. `reason` is a `Reason` or a reason an agent reported."""

    reason: str = Reason.INTERNAL

    def __init__(self, reason: Reason | str, message: str) -> None:
        super().__init__(message)
        self.reason = str(reason)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def list_some(items: list[str], limit: int = 8) -> str:
    """`a, b, c` — or the first `limit` and how many more, so messages stay readable."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
