"""refitctl's exit statuses by class of failure, and how a failure is reported: one line on
stderr (`refitctl: error (NOT_FOUND): refit 'x' not found`), or with `--json` one JSON
object on stderr (`{"error": {"reason", "message", "field", "exit_code"}}`).

docs/operations.md lists the statuses; scripts may rely on them.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from refitplane import errors
from refitplane.protocol import Reason

EXIT_OK = 0
# `trigger --watch`, `status --watch`: the refit ended FAILED or CANCELLED; `demo`: a check failed.
EXIT_REFIT_FAILED = 1
# Bad flags or arguments (also INVALID_ARGUMENT and layout errors from the coordinator).
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
# The coordinator could not be reached, or did not answer in time.
EXIT_UNAVAILABLE = 4
EXIT_UNAUTHENTICATED = 5
# The coordinator refused the request in its current state (FAILED_PRECONDITION, CONFLICT,
# RATE_LIMITED): retrying later may succeed.
EXIT_REJECTED = 6
EXIT_INTERNAL = 7
EXIT_INTERRUPTED = 130

# Most specific class first.
_BY_CLASS: tuple[tuple[type[errors.RefitError], int], ...] = (
    (errors.InvalidArgument, EXIT_USAGE),
    (errors.NotFound, EXIT_NOT_FOUND),
    (errors.Unavailable, EXIT_UNAVAILABLE),
    (errors.TransferTimeout, EXIT_UNAVAILABLE),
    (errors.Unauthenticated, EXIT_UNAUTHENTICATED),
    (errors.FailedPrecondition, EXIT_REJECTED),
    (errors.Conflict, EXIT_REJECTED),
    (errors.RateLimited, EXIT_REJECTED),
    (errors.TransferError, EXIT_REFIT_FAILED),
)


class UsageError(errors.InvalidArgument):
    """A flag or argument argparse refused."""

    reason: str = Reason.USAGE


def exit_code(exc: errors.RefitError) -> int:
    for cls, code in _BY_CLASS:
        if isinstance(exc, cls):
            return code
    return EXIT_INTERNAL


def report(exc: errors.RefitError, *, as_json: bool, out: TextIO | None = None) -> int:
    """Print the failure (stderr by default) and return its exit status."""
    out = out or sys.stderr
    code = exit_code(exc)
    if as_json:
        doc = {"reason": exc.reason, "message": exc.message, "field": exc.field, "exit_code": code}
        print(json.dumps({"error": doc}), file=out)
    else:
        print(f"refitctl: error ({exc.reason}): {exc.message}", file=out)
    return code
