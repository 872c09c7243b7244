"""When a job counts as forgotten: idle (no member, no refit running) without a break for
`REFIT_JOB_IDLE_S`. The coordinator asks `due()` on every sweep and collects what it names;
`IdleClock` only keeps time, so the decision is testable without a coordinator."""

from __future__ import annotations

from collections.abc import Mapping

# Sweeps per idle period (and at most this long apart), so a job is collected at most
# a quarter of the idle time late, and live members' layouts are refreshed well before
# their TTL runs out.
SWEEPS_PER_IDLE = 4
MAX_SWEEP_INTERVAL_S = 60.0


def sweep_interval(idle_s: float, layout_ttl_s: float) -> float:
    return max(0.05, min(MAX_SWEEP_INTERVAL_S, idle_s, layout_ttl_s) / SWEEPS_PER_IDLE)


class IdleClock:
    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._since: dict[str, float] = {}  # job → when it was first seen idle

    def due(self, now: float, idle: Mapping[str, bool]) -> list[str]:
        """Jobs idle since at least `idle_s` before `now`. `idle`: every job known now and
        whether it is idle at this moment (a job busy once starts its clock again)."""
        for job in [j for j in self._since if not idle.get(j, False)]:
            del self._since[job]
        for job, is_idle in idle.items():
            if is_idle:
                self._since.setdefault(job, now)
        return sorted(job for job, since in self._since.items() if now - since >= self.idle_s)

    def reset(self, job: str) -> None:
        self._since.pop(job, None)
