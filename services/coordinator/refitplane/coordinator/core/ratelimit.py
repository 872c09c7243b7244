"""Per-job trigger rate limit: a token bucket refilled at `rate` per second."""

from __future__ import annotations

import time

from refitplane.errors import RateLimited


class TriggerRateLimiter:
    def __init__(self, rate_per_s: float) -> None:
        self._rate = rate_per_s
        self._burst = max(1.0, rate_per_s)
        self._buckets: dict[str, tuple[float, float]] = {}  # job → (tokens, last refill)

    def check(self, job: str) -> None:
        """Take one token for `job` or raise RateLimited (no-op when the rate is 0)."""
        if self._rate <= 0:
            return
        now = time.monotonic()
        tokens, last = self._buckets.get(job, (self._burst, now))
        tokens = min(self._burst, tokens + (now - last) * self._rate)
        if tokens < 1.0:
            self._buckets[job] = (tokens, now)
            raise RateLimited(
                f"job {job!r} is limited to {self._rate:g} triggers per second", field="job"
            )
        self._buckets[job] = (tokens - 1.0, now)

    def forget(self, job: str) -> None:
        """Drop a forgotten job's bucket (it starts full should the job come back)."""
        self._buckets.pop(job, None)
