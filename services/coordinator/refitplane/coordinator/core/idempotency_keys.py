"""Idempotency keys survive a store that lost its state.

A trigger's idempotency key lives in the store (`idem:{job}:{key}`, 7 days). A store that
comes back empty forgets it, and the same key would then create a second refit — the defect
issue 22 lists. So the coordinator remembers the keys it handed out (and the latest record
of each refit they name) and, when it re-seeds a store that lost its state
(`lost_state.StoreWatch`), writes them back with the rest of their time: the key answers
with the refit it named, as before the loss.

Bounded: the newest `capacity` keys (4,096) are kept; older ones, and every key when the
coordinator itself restarted on the empty store (its memory went with it), are not
recovered (docs/coordinator.md#when-the-store-loses-its-state).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from refitplane.coordinator.core.records import RefitRecord, TriggerRequest

DEFAULT_CAPACITY = 4096


@dataclass(frozen=True)
class RememberedKey:
    job: str
    key: str
    refit: RefitRecord
    ttl_s: int  # what is left of the key's time in the store


class KeyMemory:
    def __init__(
        self,
        *,
        key_ttl_s: int = TriggerRequest.model_fields["key_ttl_s"].default,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self._ttl = key_ttl_s
        self._capacity = capacity
        # (job, key) → (refit id, when the key expires, unix)
        self._keys: collections.OrderedDict[tuple[str, str], tuple[str, float]] = (
            collections.OrderedDict()
        )
        # The latest record of every refit a remembered key names.
        self._records: dict[str, RefitRecord] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def remember(self, job: str, key: str, refit: RefitRecord, now: float | None = None) -> None:
        """A trigger with `key` answered `refit` (created, coalesced into, or found)."""
        if not key:
            return
        now = time.time() if now is None else now
        entry = (job, key)
        # A key found again keeps the expiry the store gave it when it was first used.
        if entry not in self._keys or self._keys[entry][0] != refit.refit_id:
            self._keys[entry] = (refit.refit_id, now + self._ttl)
        self._keys.move_to_end(entry)
        self.seen(refit, named=True)
        while len(self._keys) > self._capacity:
            _, (dropped, _) = self._keys.popitem(last=False)
            if all(refit_id != dropped for refit_id, _ in self._keys.values()):
                self._records.pop(dropped, None)

    def seen(self, record: RefitRecord, *, named: bool = False) -> None:
        """Every record the coordinator publishes: keep the latest of the remembered ones."""
        if named or record.refit_id in self._records:
            self._records[record.refit_id] = record

    def live(self, now: float | None = None) -> list[RememberedKey]:
        """The keys not yet expired, with their refit's latest record, oldest first."""
        now = time.time() if now is None else now
        return [
            RememberedKey(job, key, self._records[refit_id], int(expires - now))
            for (job, key), (refit_id, expires) in self._keys.items()
            if expires - now >= 1 and refit_id in self._records
        ]
