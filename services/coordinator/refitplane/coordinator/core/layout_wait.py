"""A refit triggered while members are (re-)joining waits for their layouts.

A member publishes its layout right after it (re-)registers — a trainer rejoining after a
stall, a restarted vLLM worker. A refit triggered in between waits for those layouts (up to
the prepare timeout, counted from each registration) instead of failing at once with
LAYOUT_MISSING; members registered longer ago than that are not waited for (planning then
names them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from refitplane.coordinator.core.failures import list_some
from refitplane.coordinator.core.membership import Membership
from refitplane.coordinator.core.run import RefitRun
from refitplane.coordinator.core.waits import wait_event

log = logging.getLogger(__name__)

# Layouts arrive over RPCs that do not signal the run: how often to look again.
_POLL_S = 0.02


async def await_layouts(
    run: RefitRun,
    membership: Membership,
    job: str,
    window_s: float,
    stopping: Callable[[], bool],
) -> None:
    """Return once no live data-plane member of `job` registered within `window_s` lacks
    its layout (or the driver is `stopping`); raise the run's failure if it is cancelled
    meanwhile."""
    logged = False
    while True:
        if run.failure is not None:  # cancelled while waiting
            raise run.failure
        now = time.time()
        joining = [
            m
            for m in membership.of_job(job)
            if m.alive
            and m.role.is_data_plane
            and not m.layout_digest
            and now - m.registered_unix < window_s
        ]
        if not joining or stopping():
            return
        if not logged:
            log.info(
                "refit %s waits for the layout of %s (registered %.2f s ago)",
                run.refit_id,
                list_some([m.describe() for m in joining]),
                now - max(m.registered_unix for m in joining),
            )
            logged = True
        run.changed.clear()
        await wait_event(run.changed, _POLL_S)
