"""Who a refit involves (`Cast`), decided when it is planned and not changed after: every
trainer rank, every data-plane rank and the sidecar of each target replica (`Participant`,
with its rank in the transfer group), and everyone else in the group it messages. Read by
the refit's run state (`run`), its delta choice (`delta`) and the driver."""

from __future__ import annotations

from dataclasses import dataclass, field

from refitplane.coordinator.core.planning import ReplicaMembers
from refitplane.coordinator.core.records import MemberRecord
from refitplane.protocol import Role
from refitplane.protocol.messages import RANKS_VERIFIED_LABEL


@dataclass
class Participant:
    member: MemberRecord
    # -1 for sidecars (not in the group)
    group_rank: int

    @property
    def data_plane(self) -> bool:
        return self.member.role.is_data_plane


@dataclass(frozen=True)
class Cast:
    """Who a refit involves, decided when it is planned and not changed after."""

    participants: dict[str, Participant] = field(default_factory=dict)
    # Everyone this refit involves (participants and the group's other members), for messages
    members: dict[str, MemberRecord] = field(default_factory=dict)
    # replica id → the member ids of its data-plane ranks / its sidecar
    replica_ranks: dict[str, list[str]] = field(default_factory=dict)
    replica_sidecar: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def of(
        group: list[MemberRecord], trainers: list[MemberRecord], targets: list[ReplicaMembers]
    ) -> Cast:
        """Every trainer rank sends; every rank and the sidecar of each target replica takes
        part. `group` (every data-plane member, in group-rank order) gives the group ranks."""
        cast = Cast(members={m.member_id: m for m in group})
        rank_of = {m.member_id: i for i, m in enumerate(group)}
        for m in trainers:
            cast.participants[m.member_id] = Participant(m, rank_of[m.member_id])
        for rep in targets:
            cast.replica_ranks[rep.replica_id] = [m.member_id for m in rep.ordered()]
            for m in rep.ordered():
                cast.participants[m.member_id] = Participant(m, rank_of[m.member_id])
            if rep.sidecar is not None:
                cast.participants[rep.sidecar.member_id] = Participant(rep.sidecar, -1)
                cast.members[rep.sidecar.member_id] = rep.sidecar
                cast.replica_sidecar[rep.replica_id] = rep.sidecar.member_id
        return cast

    def data_members(self) -> list[str]:
        return [i for i, p in self.participants.items() if p.data_plane]

    def waits_for_ranks_verified(self, member_id: str) -> bool:
        """A sidecar that registered the RanksVerified label: told in StartTransfer that
        RanksVerified will come, and sent it (`RefitRun.ranks_verified`)."""
        m = self.members.get(member_id)
        return (
            m is not None
            and m.role is Role.GENERATOR_SIDECAR
            and m.labels.get(RANKS_VERIFIED_LABEL) == "push"
        )

    def receives_staged(self, replica: str) -> bool:
        """Every rank of `replica` receives into staging (label receive_mode=staged): its
        live weights do not change until the reload, which reports."""
        ranks = self.replica_ranks.get(replica, [])
        return bool(ranks) and all(
            (m := self.members.get(mid)) is not None and m.labels.get("receive_mode") == "staged"
            for mid in ranks
        )
