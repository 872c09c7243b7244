"""Which replicas of a job are DEGRADED: their weights may have changed in a refit that did
not finish, so they need a full refit (never a delta) and the topology says so."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from refitplane.coordinator.core.records import MemberRecord, ReplicaRecord
from refitplane.coordinator.store.base import Store

# What a generator rank reported holding: (version, serving).
Held = tuple[int, bool]


class ReplicaHealth:
    """One job's replica records; the only writer of them."""

    def __init__(self, job: str, store: Store) -> None:
        self.job = job
        self._store = store
        self.records: dict[str, ReplicaRecord] = {}

    def load(self, records: Mapping[str, ReplicaRecord]) -> None:
        self.records = dict(records)

    async def set_degraded(
        self, replicas: Iterable[str], *, degraded: bool, unverified: bool = False
    ) -> None:
        """`unverified`: degraded because what the ranks hold is unknown (a coordinator died
        mid-transfer); `adopt` settles it from their reports."""
        changed = []
        for replica in replicas:
            old = self.records.get(replica)
            if old is None or (old.degraded, old.unverified) != (degraded, unverified):
                changed.append(
                    ReplicaRecord(replica_id=replica, degraded=degraded, unverified=unverified)
                )
        if changed:
            # Store first, as in `GroupEpochs.poison`: a failed write is retried, not forgotten.
            await self._store.save_replicas(self.job, changed)
            for record in changed:
                self.records[record.replica_id] = record

    def unverified(self, replica: str) -> bool:
        record = self.records.get(replica)
        return record is not None and record.unverified

    async def adopt(self, replica: str, ranks: list[MemberRecord], held: Mapping[str, Held]) -> int:
        """The kill -9 rule: an unverified replica takes what its ranks report once every
        live rank reported. All serving one version V: not degraded, and V is returned (the
        caller records it as each rank's version). Otherwise it stays DEGRADED (some rank
        cannot serve, or they disagree), now verified; returns 0. Also 0 while waiting."""
        if not self.unverified(replica) or any(m.member_id not in held for m in ranks):
            return 0
        reports = {held[m.member_id] for m in ranks}
        version, serving = next(iter(reports))
        if len(reports) == 1 and serving and ranks:
            await self.set_degraded([replica], degraded=False)
            return version
        await self.set_degraded([replica], degraded=True)
        return 0
