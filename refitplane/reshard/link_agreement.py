"""Which delta links run the full path, agreed by both ends without a round trip of its own.

A sender whose link rate no delta can beat (`delta_cost.never_pays`) writes `FULL_PATH` into
the last row of each checksum table it sends at the end of a refit (`run_checksums`);
both ends keep the word per (src, dst) link with their communication group
(`Transport.full_links`), and the link's next "auto" delta refit runs exactly a full
refit's path on both ends: no sample, no scan, no header table (so the receiver waits for
none), no snapshot work. The word is renewed by every refit that runs the link, and a
failed refit drops the group with it, so the ends cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch

from refitplane.reshard.delta_exchange import DeltaLinks

# The sender's word in the last row of its checksum table: no delta can win on this link
# (any other value: the link may exchange deltas).
FULL_PATH = 1

Link = tuple[int, int]


def without_full_links(
    delta: DeltaLinks | None, rank: int, links: Iterable[Link], agreed: frozenset[Link]
) -> tuple[DeltaLinks | None, int]:
    """`delta` without the peers whose every link with `rank` (among `links`, this rank's
    links in the schedule) is `agreed` to run in full, and how many peers that removed.
    "auto" only: "on" asks for deltas whatever the link."""
    if delta is None or not delta.peers or delta.mode != "auto" or not agreed:
        return delta, 0
    mine = [link for link in links if rank in link]
    full = frozenset(
        peer
        for peer in delta.peers
        if (with_peer := [link for link in mine if peer in link])
        and all(link in agreed for link in with_peer)
    )
    if not full:
        return delta, 0
    return replace(delta, peers=delta.peers - full), len(full)


def agreed_after(
    agreed: frozenset[Link],
    rank: int,
    links: Iterable[Link],
    never_pays: bool,
    arrived: Mapping[Link, torch.Tensor],
) -> frozenset[Link]:
    """The links agreed to run in full after a checksum exchange: a sender takes its own
    word (`never_pays`) once its tables went, a receiver the last row of each table that
    arrived (`arrived`, on the host)."""
    full = set(agreed)
    for link in links:
        word = (FULL_PATH if never_pays else 0) if link[0] == rank else int(arrived[link][-1, 0])
        if word == FULL_PATH:
            full.add(link)
        else:
            full.discard(link)
    return frozenset(full)
