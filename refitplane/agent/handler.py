"""What an agent implements: one method per coordinator command.

Commands run one at a time, in order, on the session's worker thread (a long transfer
delays later commands). AbortRefit and LeaveGroup are *also* delivered at once, from the
stream thread, to `on_abort_now`, so a running transfer can be cancelled. RanksVerified is
delivered only at once, from the stream thread, to `on_ranks_verified` (a replica controller
waits for it inside its StartTransfer, on the worker thread). A method that
raises turns into a Failure report (a `RefitError`'s `reason`, else AGENT_ERROR; an
exception attribute `weights_modified = True` is passed on). Handlers report success
themselves through the session's `report_*` methods.

JoinGroup of a newer epoch replaces any group the agent still holds.
"""

from __future__ import annotations

from typing import Protocol

from refitplane.protocol.messages import (
    AbortRefitCmd,
    CreateRendezvousCmd,
    JoinGroupCmd,
    LeaveGroupCmd,
    PrepareRefitCmd,
    RanksVerifiedCmd,
    StartTransferCmd,
)


class CommandHandler(Protocol):
    def on_create_rendezvous(self, cmd: CreateRendezvousCmd) -> None:
        """Group rank 0: create the epoch's rendezvous, then `report_rendezvous_ready`."""

    def on_join_group(self, cmd: JoinGroupCmd) -> None:
        """Build the communicator(s), then `report_group_joined`."""

    def on_leave_group(self, cmd: LeaveGroupCmd) -> None:
        """Tear down the epoch's communicator(s) (in order with the other commands)."""

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        """Get ready (trainers: hold the weights read-only; sidecars: pause the engine),
        then `report_prepared`."""

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        """Run the plan; `report_progress` along the way, `report_transfer_done` at the end
        (sidecars: drive the engine's update, then `report_replica_updated`)."""

    def on_abort_refit(self, cmd: AbortRefitCmd) -> None:
        """In order with the other commands: clean up after an aborted refit."""

    def on_abort_now(self, cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        """Immediately, from the stream thread: cancel whatever is running. Must not block."""

    def on_ranks_verified(self, cmd: RanksVerifiedCmd) -> None:
        """Immediately, from the stream thread (sidecars): every rank of the replica verified
        its share of the refit. Must not block."""


class NullHandler:
    """Does nothing; subclass and override what an agent needs."""

    def on_create_rendezvous(self, cmd: CreateRendezvousCmd) -> None:
        return None

    def on_join_group(self, cmd: JoinGroupCmd) -> None:
        return None

    def on_leave_group(self, cmd: LeaveGroupCmd) -> None:
        return None

    def on_prepare_refit(self, cmd: PrepareRefitCmd) -> None:
        return None

    def on_start_transfer(self, cmd: StartTransferCmd) -> None:
        return None

    def on_abort_refit(self, cmd: AbortRefitCmd) -> None:
        return None

    def on_abort_now(self, cmd: AbortRefitCmd | LeaveGroupCmd) -> None:
        return None

    def on_ranks_verified(self, cmd: RanksVerifiedCmd) -> None:
        return None
