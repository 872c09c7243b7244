"""`SidecarState`: what a replica controller knows of its replica between commands (the
version it serves, whether it is paused or not ready, and what the current refit did to the
engine). The controller's command handler and its engine steps share one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SidecarState:
    version: int = 0
    paused: bool = False
    degraded: bool = False
    refit_id: str = ""
    # This sidecar started a weight update in vLLM that it has not finished yet.
    update_open: bool = False
    # The engine may have written live weights of the current refit.
    weights_touched: bool = False
    # The engine was asleep when the refit began, and this sidecar woke its weights.
    woke: bool = False
    # They were woken from sleep level 2: they do not hold the version the replica served,
    # so from then on the replica counts as modified until a refit commits.
    weights_lost: bool = False
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
