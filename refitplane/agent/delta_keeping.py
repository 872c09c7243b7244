"""A data-plane rank's delta base (`DeltaBaseKeeping`, a part of `dataplane.DataPlaneMember`):
which links of a refit exchange deltas, against which base, and what a sender keeps of its
last complete send for the next one (`reshard.delta_base.DeltaSnapshot`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from refitplane.protocol.messages import PrepareRefitCmd
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.delta_base import DeltaSnapshot
from refitplane.reshard.delta_exchange import DeltaLinks
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport

log = logging.getLogger(__name__)


class DeltaBaseKeeping:
    """The delta-refit part of a data-plane rank (set by `DataPlaneMember.__init__`)."""

    delta_snapshot: DeltaSnapshot | None
    _shards: Callable[[], LocalShards]

    def _check_delta_base(self, cmd: PrepareRefitCmd) -> None:
        """A sender named for deltas that does not hold the base the coordinator assumes (it
        lost it to a failed transfer the coordinator did not hear of) sends every message
        dense: the refit goes on in full, nothing is encoded against other bytes."""
        if not cmd.delta_peers or self.delta_snapshot is None:
            return
        if self._delta_base(cmd, self._shards()) is None:
            held = self.delta_snapshot.version
            log.warning(
                "refit %s: deltas against version %d asked, but this rank's delta base is %s; "
                "sending in full",
                cmd.refit_id,
                cmd.delta_base_version,
                f"version {held}" if held else "empty (or of other boxes)",
            )

    def _delta_base(self, cmd: PrepareRefitCmd, shards: LocalShards) -> LocalShards | None:
        snapshot = self.delta_snapshot
        if snapshot is None or snapshot.version != cmd.delta_base_version:
            return None
        return snapshot.base_for(shards)

    def _delta_links(self, cmd: PrepareRefitCmd, shards: LocalShards) -> DeltaLinks | None:
        if not cmd.delta_peers or cmd.config is None or cmd.config.delta == "off":
            return None
        return DeltaLinks(
            peers=cmd.delta_peers,
            base=self._delta_base(cmd, shards),
            mode=cmd.config.delta,
            max_changed=cmd.config.delta_max_changed,
            current=shards,
        )

    def _keep_delta_base(
        self,
        config: TransferConfig,
        shards: LocalShards,
        report: TransferReport,
        *,
        sent: bool,
        version: int,
    ) -> None:
        """After a transfer under the weights' hold: a rank that `sent` keeps the bytes it
        sent as the base of version `version` (or releases it where deltas are off or can
        never pay on its links)."""
        snapshot = self.delta_snapshot
        if snapshot is None or not sent:
            return
        if config.delta == "off":
            snapshot.release()  # deltas turned off: give the memory back
            return
        if not report.delta_base_needed and snapshot.nbytes:
            # No delta can beat this rank's links (`delta_cost.never_pays`): it keeps no base
            # and reports none, so the coordinator asks for no delta: plain full refits.
            log.info(
                "no delta can beat this rank's link rate: delta base released (%d bytes)",
                snapshot.nbytes,
            )
        snapshot.after_send(shards, version, report)
