"""A rank's TransferDone checked against what the plan gives that rank.

An agent's report is a claim; the plan is the coordinator's own fact. A report that does
not add up (a receiver naming fewer tensors than its plan sends it, bytes that are not its
share) fails the refit with REPORT_MISMATCH instead of letting it commit — whether the
cause is a bug or a caller acting in bad faith. With the receivers' `tensors_total` pinned
to the plan, a refit can never commit on a rank that has work and verified nothing
(`_settle` requires verified == total).
"""

from __future__ import annotations

from refitplane.protocol import messages as msg
from refitplane.reshard.plan import RankPlan


def transfer_done_mismatch(plan: RankPlan, done: msg.TransferDone, *, delta: bool) -> str | None:
    """What in `done` contradicts `plan` (None when it adds up). `delta`: some of this
    rank's links went as deltas, so its bytes on the wire are at most its share (a delta is
    never larger than the dense message), and only a sender's `bytes_full` is exact."""
    problems: list[str] = []
    tensors = plan.tensors_received
    if done.tensors_total != tensors:
        problems.append(f"tensors_total {done.tensors_total}, the plan sends it {tensors}")
    if done.tensors_verified > done.tensors_total:
        problems.append(
            f"tensors_verified {done.tensors_verified} exceeds tensors_total {done.tensors_total}"
        )
    if delta:
        if plan.send_bytes and done.bytes_full != plan.send_bytes:
            problems.append(f"bytes_full {done.bytes_full}, the plan sends {plan.send_bytes}")
        if done.bytes_sent > plan.send_bytes:
            problems.append(f"bytes_sent {done.bytes_sent}, the plan sends {plan.send_bytes}")
    else:
        if done.bytes_sent != plan.send_bytes:
            problems.append(f"bytes_sent {done.bytes_sent}, the plan sends {plan.send_bytes}")
        if done.bytes_received != plan.recv_bytes:
            problems.append(
                f"bytes_received {done.bytes_received}, the plan sends it {plan.recv_bytes}"
            )
    return "; ".join(problems) or None
