"""What every job driver shares: the coordinator's settings, store, membership, command
outbox, refit events, metrics and plan cache."""

from __future__ import annotations

from dataclasses import dataclass

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
