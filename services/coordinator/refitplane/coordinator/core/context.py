"""What every job driver shares: the coordinator's settings, store, membership, command
outbox, refit events, metrics and plan cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from refitplane.coordinator.core.events import RefitEvents
from refitplane.coordinator.core.membership import Membership
from refitplane.coordinator.core.metrics import Metrics
from refitplane.coordinator.core.outbox import Outbox
from refitplane.coordinator.core.planning import PlanCache
from refitplane.coordinator.settings import Settings
from refitplane.coordinator.store.base import Store


@dataclass
class DriverContext:
    """What every job driver shares."""

    settings: Settings
    store: Store
    membership: Membership
    outbox: Outbox
    events: RefitEvents
    metrics: Metrics
    plans: PlanCache
    # Called when a driver's write finds the store lost its state (`StoreStateLost`): the
    # store check runs at once instead of at its next interval.
    store_lost: Callable[[], None] = field(default=lambda: None)
