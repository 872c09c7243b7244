"""What one rank's transfer did (`TransferReport`: bytes, messages, checksums, host time by
phase) and the progress callback the executor reports to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


ProgressFn = Callable[[int, int], None]


@dataclass
class TransferReport:
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    messages: int = 0
    direct_messages: int = 0
    packed_messages: int = 0
    groups: int = 0
    tensors_total: int = 0
    tensors_verified: int = 0
    # refitplane's own staging memory held during the run: the ring reserved for the plan's
    # packed messages plus a staged receiver's arena (`staged_peak_bytes`); within
    # `max_inflight_bytes` (`prepared_plan.staging_room`).
    staging_peak_bytes: int = 0
    # The staging ring reserved for this run (0: every message went direct), and the most of
    # it in use at once.
    ring_bytes: int = 0
    ring_peak_bytes: int = 0
    # Delta refits: what a full refit would have sent (bytes_sent is what went on the
    # wire), and the messages that went as deltas.
    bytes_full: int = 0
    delta_messages: int = 0
    # A sender's delta base was advanced to the bytes sent while encoding (no snapshot copy
    # needed once the transfer completed; see `DeltaExchange.advanced`).
    delta_base_advanced: bool = False
    # Host seconds of the delta exchange before the first message (senders: scan, counts
    # read back, payloads written; both ends: the header tables swapped).
    delta_seconds: float = 0.0
    # Delta links of this run: header tables swapped (sent + received; 0 where every link
    # ran the full path), and links that ran the full path because both ends agreed at the
    # previous refit that no delta can win on them (`transfer_run`: no sample, no header
    # swap, no snapshot work, checksums as in a full refit).
    delta_tables: int = 0
    delta_full_links: int = 0
    # Senders: whether a later delta could ever pay on their links at the link rate they
    # decide against (`delta_cost.never_pays`); False: the delta base may be dropped.
    delta_base_needed: bool = True
    # From the first message added to the last completed (connections, staging room and the
    # delta exchange before it, verification after): what the link rate is measured over.
    wire_seconds: float = 0.0
    # Staged receivers (`StagedShards`): buckets of stages, how many were applied during the
    # transfer (the last one is left to the owner), and the staging arena's size.
    staged_buckets: int = 0
    staged_applied: int = 0
    staged_peak_bytes: int = 0
    # Host-side timeline, from the start of `run`: schedule and views resolved; every
    # transfer posted (the rest of `seconds` is waiting for the devices and verifying).
    prepared_seconds: float = 0.0
    posted_seconds: float = 0.0
    # From the start of `run` to this rank's first group posted: how long a byte of this
    # rank's first waited on it (0.0: nothing posted).
    first_post_seconds: float = 0.0
    # Of it, the first group's posting call (`Transport.issue`), and within that the wait
    # for the communicator to take the group (non-blocking NCCL's `ncclGroupEnd` in
    # progress): what an armed run still spends before its first byte can move.
    first_post_call_seconds: float = 0.0
    first_post_settle_seconds: float = 0.0
    # A run armed at PrepareRefit (`Executor.arm`): how long arming took there, before the
    # start (0.0: built when the start came, inside `prepared_seconds`).
    armed_seconds: float = 0.0
    # Host time by phase (a profile of the posting loop): adding messages to groups,
    # posting groups (packing launches, NCCL calls), queueing unpacking and checksums,
    # waiting for groups to complete, and the final exchange of checksum vectors.
    host_add_seconds: float = 0.0
    host_post_seconds: float = 0.0
    # Parts of posting: packing launches, and the transport's wait after a group's post
    # until the communicator took it (non-blocking NCCL: `ncclGroupEnd` in progress).
    host_pack_seconds: float = 0.0
    host_settle_seconds: float = 0.0
    host_after_seconds: float = 0.0
    host_wait_seconds: float = 0.0
    verify_seconds: float = 0.0
