"""Which replicas of a job are DEGRADED: their weights may have changed in a refit that did
not finish, so they need a full refit (never a delta) and the topology says so."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from refitplane.coordinator.core.records import ReplicaRecord
from refitplane.coordinator.store.base import Store


class ReplicaHealth:
    """One job's replica records; the only writer of them."""

    def __init__(self, job: str, store: Store) -> None:
        self.job = job
        self._store = store
        self.records: dict[str, ReplicaRecord] = {}

    def load(self, records: Mapping[str, ReplicaRecord]) -> None:
        self.records = dict(records)

    async def set_degraded(self, replicas: Iterable[str], *, degraded: bool) -> None:
        changed = []
        for replica in replicas:
            old = self.records.get(replica)
            if old is None or old.degraded != degraded:
                changed.append(ReplicaRecord(replica_id=replica, degraded=degraded))
        if changed:
            # Store first, as in `GroupEpochs.poison`: a failed write is retried, not forgotten.
            await self._store.save_replicas(self.job, changed)
            for record in changed:
                self.records[record.replica_id] = record
