"""One refit's hop timeline (issue 23) as a line of text: where TRANSFERRING went between
the coordinator's StartTransfer and the end of the phase, per data-plane rank, from the
stamps the refit's record keeps (`Refit.start_sent_ns`, `transfer_end_ns` and each
`RankProgress`'s). Every stamp is a `time.time_ns()` wall clock: the differences between
a rank's and the coordinator's stamps mean something only where they share one host."""

from __future__ import annotations

from refitplane.protocol import RefitState
from refitplane.protocol.models import RankProgress, Refit

# The hops, in order: (label, the stamp it starts at, the stamp it ends at); "start_sent"
# is the coordinator's StartTransfer.
_HOPS = (
    ("coordinator->start seen", "start_sent", "start_seen_ns"),
    ("start->executor", "start_seen_ns", "executor_start_ns"),
    ("executor", "executor_start_ns", "executor_end_ns"),
    ("executor end->TransferDone sent", "executor_end_ns", "done_sent_ns"),
    ("sent->recorded", "done_sent_ns", "done_recorded_ns"),
)


def stamped_ranks(refit: Refit) -> list[RankProgress]:
    """The ranks whose TransferDone carried a hop timeline, by member id."""
    return sorted((r for r in refit.ranks if r.done_recorded_ns), key=lambda r: r.member_id)


def hop_ms(refit: Refit, rank: RankProgress) -> dict[str, float | None]:
    """One rank's hops in ms (None where either end was not stamped)."""
    out: dict[str, float | None] = {}
    for label, begin, end in _HOPS:
        a = refit.start_sent_ns if begin == "start_sent" else getattr(rank, begin)
        b = getattr(rank, end)
        out[label] = (b - a) / 1e6 if a and b else None
    return out


def last_report_to_phase_end_ms(refit: Refit) -> float | None:
    """From the last TransferDone the coordinator accepted to the end of TRANSFERRING."""
    last = max((r.done_recorded_ns for r in refit.ranks), default=0)
    return (refit.transfer_end_ns - last) / 1e6 if last and refit.transfer_end_ns else None


def phase_entry_to_start_sent_ms(refit: Refit) -> float | None:
    """From entering TRANSFERRING to StartTransfer sent: the phase's own time less the
    stamped part (the TRANSFERRING record's store write, before any StartTransfer goes out)."""
    phase_s = sum(t.seconds for t in refit.timings if t.phase is RefitState.TRANSFERRING)
    if not (phase_s and refit.start_sent_ns and refit.transfer_end_ns):
        return None
    return phase_s * 1e3 - (refit.transfer_end_ns - refit.start_sent_ns) / 1e6


def hop_line(refit: Refit, names: dict[str, str] | None = None) -> str:
    """ "hops: coordinator->start seen X ms (per member), start->executor Y, executor Z, ...,
    last report->phase end U, phase entry->start sent T": each hop's ms per rank, ranks in the order of the header,
    `-` where not stamped. `names`: a short name per member id (default: the id)."""
    ranks = stamped_ranks(refit)
    if not ranks:
        return "hops: none stamped (the ranks or the coordinator predate the hop timeline)"
    per_rank = [hop_ms(refit, r) for r in ranks]

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    who = ", ".join((names or {}).get(r.member_id, r.member_id) for r in ranks)
    parts = [
        f"{label} {'/'.join(fmt(h[label]) for h in per_rank)}" + (" ms" if i == 0 else "")
        for i, (label, _, _) in enumerate(_HOPS)
    ]
    parts.append(f"last report->phase end {fmt(last_report_to_phase_end_ms(refit))}")
    parts.append(f"phase entry->start sent {fmt(phase_entry_to_start_sent_ms(refit))}")
    return f"hops ({who}): " + ", ".join(parts)
