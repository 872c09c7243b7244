"""Delta refits: which trainer ranks keep which version as their delta base, and, per refit,
which target replicas take a delta (only what changed since that base) instead of the full
weights. Everything else — a first refit, a new or restarted trainer, a changed trainer
layout, a DEGRADED replica — takes the full path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from refitplane.coordinator.core.cast import Cast
from refitplane.coordinator.core.membership import Membership
from refitplane.coordinator.core.planning import PlannedRefit
from refitplane.coordinator.core.records import MemberRecord, ReplicaRecord
from refitplane.protocol import Role
from refitplane.protocol import messages as msg


@dataclass(frozen=True)
class DeltaChoice:
    """A refit's delta: each data-plane member's peers that exchange a delta (group ranks),
    the base version they share, and the target replicas that take it."""

    peers: Mapping[str, frozenset[int]] = field(default_factory=dict)
    base_version: int = 0
    replicas: tuple[str, ...] = ()


NO_DELTA = DeltaChoice()


class DeltaBases:
    """Trainer member id → (its layout digest, the version it keeps as its delta base), from
    its last TransferDone. In memory only: after a restart refits go in full until every
    trainer sent once more."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, int]] = {}

    def transfer_done(self, trainer: MemberRecord, body: msg.TransferDone) -> None:
        if body.delta_base_version:
            self._held[trainer.member_id] = (trainer.layout_digest, body.delta_base_version)
        else:
            self._held.pop(trainer.member_id, None)

    def forget(self, trainer_id: str) -> None:
        """Whatever the trainer's base is now, the next refit does not rely on it."""
        self._held.pop(trainer_id, None)

    def choose(
        self,
        mode: Literal["off", "auto", "on"],
        cast: Cast,
        planned: PlannedRefit,
        membership: Membership,
        replicas: Mapping[str, ReplicaRecord],
    ) -> DeltaChoice:
        """Which target replicas take a delta: those whose every rank holds, intact, the
        version every trainer rank keeps as its delta base (taken of the layout it has now)
        and can apply one in place."""
        if mode == "off":
            return NO_DELTA
        # Only the ranks that send in this refit need a base (a DP copy that the planner
        # leaves idle sends nothing).
        trainers = [
            p.member
            for p in cast.participants.values()
            if p.member.role is Role.TRAINER and planned.rank_plans[p.group_rank].send_bytes
        ]
        if not trainers:
            return NO_DELTA
        bases = set()
        for trainer in trainers:
            current = membership.find(trainer.member_id)
            held = self._held.get(trainer.member_id)
            if current is None or held is None or held[0] != current.layout_digest:
                return NO_DELTA
            bases.add(held[1])
        if len(bases) != 1:
            return NO_DELTA
        base = bases.pop()
        chosen: list[str] = []
        for replica, rank_ids in cast.replica_ranks.items():
            record = replicas.get(replica)
            if record is not None and record.degraded:
                continue
            members = [membership.find(i) for i in rank_ids]
            if all(m is not None and m.delta_receive and m.version == base for m in members):
                chosen.append(replica)
        if not chosen:
            return NO_DELTA
        trainer_ranks = frozenset(cast.participants[t.member_id].group_rank for t in trainers)
        peers: dict[str, frozenset[int]] = {}
        receiver_ranks: set[int] = set()
        for replica in chosen:
            for member_id in cast.replica_ranks[replica]:
                peers[member_id] = trainer_ranks
                receiver_ranks.add(cast.participants[member_id].group_rank)
        for trainer in trainers:
            peers[trainer.member_id] = frozenset(receiver_ranks)
        return DeltaChoice(peers=peers, base_version=base, replicas=tuple(sorted(chosen)))
