"""The coordinator's bearer-token check takes as long whether a wrong token differs from the
right one in its first byte or its last: nothing about the token leaks through timing.

A plain `==` stops at the first differing byte, so with a 1 MiB token a first-byte mismatch
is answered measurably faster than a last-byte one (here: the check around the comparison
costs about as much as comparing); a constant-time comparison reads every byte both times.
The minimum over many interleaved trials is compared, which noise can only raise.
"""

from __future__ import annotations

import time

import pytest

from refitplane.coordinator.auth import TokenCheck
from refitplane.errors import Unauthenticated

pytestmark = pytest.mark.unit

SIZE = 1 << 20
TRIALS = 300


def _fastest(check: TokenCheck, header: str) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with pytest.raises(Unauthenticated):
            check.check(header)
        best = min(best, time.perf_counter() - start)
    return best


def test_mismatch_position_does_not_change_the_time() -> None:
    token = "a" * SIZE
    check = TokenCheck(token)
    first = "Bearer " + "b" + token[1:]
    last = "Bearer " + token[:-1] + "b"
    early, late = float("inf"), float("inf")
    for _ in range(TRIALS // 3):
        early = min(early, _fastest(check, first))
        late = min(late, _fastest(check, last))
    assert early / late > 0.9, f"first-byte mismatch {early * 1e6:.0f} µs, last {late * 1e6:.0f} µs"


def test_a_plain_comparison_would_be_caught() -> None:
    """The measurement can tell: the same check with `==` fails the bound above."""

    class Leaky(TokenCheck):
        def check(self, authorization: str | None) -> None:
            presented = (authorization or "").partition(" ")[2].strip().encode()
            if presented != self._token:
                raise Unauthenticated("invalid bearer token")

    token = "a" * SIZE
    check = Leaky(token)
    early, late = float("inf"), float("inf")
    for _ in range(TRIALS // 3):
        early = min(early, _fastest(check, "Bearer b" + token[1:]))
        late = min(late, _fastest(check, "Bearer " + token[:-1] + "b"))
    assert early / late < 0.9, f"first {early * 1e6:.0f} µs, last {late * 1e6:.0f} µs"
