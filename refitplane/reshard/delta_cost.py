"""Whether a message's delta beats sending it dense on its link ("auto" mode, CUDA senders).

A delta saves wire time and costs device time on both ends: the sender's scan (both images
read once) and gather, the receiver's apply. Over a network link (a few GB/s) the wire
dominates and a delta wins up to tens of percent changed; over NVLink (~360 GB/s on an
H100 pair) the wire of a whole 8B model takes ~45 ms and the scan alone ~24 ms, so a delta
may lose at any fraction (measured on 2 x H100, 2026-11-26: 1 % changed 49.8 ms against 45.7
dense, 20 % 137 ms, the receiver's bitmap applies). `DeltaCosts` models each end's cost per
message from the H100 profile of those runs; `choose` picks the cheapest of dense, index and
bitmap for a link of a given rate, and a delta only where it is predicted to take at most
`margin` of the dense time (what the model leaves out: per-message posting, the scan being
done before the first byte moves).

The model is used twice per message: before the scan, on a sampled estimate of the changed
words (`scan_first`: a message predicted to go dense is not scanned at all, its snapshot
copied instead), and after it, on the exact count, with the scan's cost sunk. Either way
dense is exact: the decision costs time, never bytes.

Per link, before a refit (`never_pays`): where even a message with nothing changed, paying
the link's exchange (`exchange_per_byte`) on top of its scan and gather, cannot beat dense,
no delta ever will on that link; the link then runs the full path (no exchange, no snapshot:
`transfer_run`'s link agreement).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from refitplane.errors import InvalidArgument
from refitplane.reshard import delta_triton
from refitplane.reshard.delta import DeltaHeader, Encoding, choose_encoding, encoded_nbytes
from refitplane.reshard.delta_batch import sample_changed
from refitplane.reshard.delta_images import Scanned

# REFIT_DELTA_LINK_GBPS: the link rate (GB/s) the senders' "auto" decisions assume; unset:
# measured by the executor from its dense transfers; "off": no cost model (the fraction
# rule alone, `delta_max_changed`).
LINK_RATE_ENV = "REFIT_DELTA_LINK_GBPS"


@dataclass(frozen=True)
class DeltaCosts:
    """Device seconds per byte of message (or per changed word) of each step of a delta,
    from the 2 x H100 profile of 2026-11-26 (BENCHMARKS.md, WB): scan 23.6 ms and gather
    10.1 ms for 16.4 GB of messages, the receiver's index applies 5.9 ms for 82 M changed
    words, its bitmap applies ~63 ms for 16.4 GB. The scan now runs faster (the base advanced
    row by row: 19.1 ms for the same bytes on 2 x H100 in the ninth session's sweep,
    `benchmarks/delta_scan_gpu.py`), but these figures are the ones the decisions were
    checked against end to end (the executor's delta refits over NVLink and sockets);
    they change when a delta refit on a GPU is measured with the new scan."""

    scan_per_byte: float = 1.44e-12
    gather_per_byte: float = 0.62e-12
    apply_bitmap_per_byte: float = 3.8e-12
    apply_index_per_word: float = 7.2e-11
    margin: float = 0.75
    # What a link pays before its first byte once it exchanges deltas at all, whatever each
    # message's encoding: the staged images, the counts' host read and the header swap,
    # 7.8 ms for the 16.4 GB of Qwen3-8B on 2 x H100 (fifth session, every message dense
    # unscanned). Only the link decision (`never_pays`) counts it: a per-message choice is
    # made with the exchange already paid.
    exchange_per_byte: float = 0.48e-12


COSTS = DeltaCosts()


def link_rate_setting() -> float | None:
    """REFIT_DELTA_LINK_GBPS as bytes per second; 0.0 for "off"; None when unset."""
    raw = os.environ.get(LINK_RATE_ENV, "").strip()
    if not raw:
        return None
    if raw.lower() == "off":
        return 0.0
    try:
        gbps = float(raw)
    except ValueError:
        gbps = -1.0
    if gbps <= 0:
        raise InvalidArgument(
            f"{LINK_RATE_ENV} must be a positive rate in GB/s or 'off', got {raw!r}",
            field=LINK_RATE_ENV,
        )
    return gbps * 1e9


def _delta_seconds(
    encoding: Encoding, nbytes: int, changed: int, word: int, rate: float, scanned: bool
) -> float:
    """Both ends' time for `encoding` of a message; the scan not counted once done."""
    costs = COSTS
    seconds = 0.0 if scanned else nbytes * costs.scan_per_byte
    seconds += nbytes * costs.gather_per_byte
    seconds += encoded_nbytes(encoding, nbytes, changed, word) / rate
    if encoding is Encoding.BITMAP:
        seconds += nbytes * costs.apply_bitmap_per_byte
    else:
        seconds += changed * costs.apply_index_per_word
    return seconds


def choose(nbytes: int, changed: int, word: int, rate: float, *, scanned: bool) -> DeltaHeader:
    """The encoding of a message of `nbytes` with `changed` words changed (`word` bytes
    each) on a link of `rate` bytes per second: the fastest sparse encoding predicted to
    take at most `margin` of the dense time, else dense (and dense wherever
    `choose_encoding` says so). `scanned`: the scan is done (its cost no longer counts)."""
    best = choose_encoding(nbytes, changed, word)
    if best.encoding is Encoding.DENSE:
        return best
    limit = COSTS.margin * nbytes / rate
    candidates = [
        DeltaHeader(kind, changed, encoded_nbytes(kind, nbytes, changed, word))
        for kind in (Encoding.INDEX, Encoding.BITMAP)
    ]
    timed = [
        (_delta_seconds(h.encoding, nbytes, changed, word, rate, scanned), h.nbytes, h)
        for h in candidates
        if h.nbytes < nbytes
    ]
    fit = [t for t in timed if t[0] <= limit]
    if not fit:
        return DeltaHeader(Encoding.DENSE, changed, nbytes)
    return min(fit, key=lambda t: (t[0], t[1]))[2]


# Word sizes (bytes) a delta message can have: the link decision holds for all of them.
_WORDS = (1, 2, 4, 8)


def never_pays(rate: float | None) -> bool:
    """Whether no delta can beat sending dense on a link of `rate` bytes per second: even a
    message with nothing changed (the best case), scanned and gathered, its link's exchange
    paid (`exchange_per_byte`), takes more than `margin` of its dense time, at every word
    size. The model is per byte, so one large message stands for all. False without a
    rate (None or 0: unknown, or "off")."""
    if not rate:
        return False
    nbytes = 1 << 30
    limit = COSTS.margin * nbytes / rate
    exchange = nbytes * COSTS.exchange_per_byte
    return all(
        exchange + _delta_seconds(Encoding.INDEX, nbytes, 0, word, rate, scanned=False) > limit
        for word in _WORDS
    )


def scan_first(nbytes: int, word: int, rate: float, max_changed: float) -> bool | None:
    """Before any scan: True where a delta wins whatever changed (up to `max_changed` of the
    words; scan without sampling), False where none can (dense, no scan), None where it
    depends on how much changed (sample first)."""
    words = nbytes // word
    at_none = choose(nbytes, 0, word, rate, scanned=False).encoding
    at_most = choose(nbytes, int(max_changed * words), word, rate, scanned=False).encoding
    if at_none is Encoding.DENSE and at_most is Encoding.DENSE:
        return False
    if at_none is not Encoding.DENSE and at_most is not Encoding.DENSE:
        return True
    return None


def to_scan(every: list[Scanned], rate: float | None, max_changed: float) -> list[int]:
    """Which of a sender's (message, current, base, word) to scan, as indices: all without a
    rate (None or 0), else those that can beat dense on the link (`scan_first`), deciding
    where it depends on how much changed from a sampled estimate (`sample_changed`)."""
    if not rate:
        return list(range(len(every)))
    first = [scan_first(m.nbytes, word, rate, max_changed) for m, _, _, word in every]
    unsure: dict[int, list[int]] = {}
    for i, verdict in enumerate(first):
        if verdict is None:
            unsure.setdefault(every[i][3], []).append(i)
    kernel = bool(every) and delta_triton.available(every[0][1])
    for word, chosen in unsure.items():
        estimates = sample_changed(
            [every[i][1] for i in chosen], [every[i][2] for i in chosen], word, kernel=kernel
        )
        for i, n in zip(chosen, estimates, strict=True):
            header = choose(every[i][0].nbytes, n, word, rate, scanned=False)
            first[i] = header.encoding is not Encoding.DENSE
    return [i for i, verdict in enumerate(first) if verdict]
