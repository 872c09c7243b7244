"""The checksum tables of one execution (`RunChecksums`, beside `transfer_run.TransferRun`):
one (S0, S1) row per message of each link, indexed by the message's round and filled as its
bytes are packed, sent or arrive; after the last message, senders ship their tables and
receivers compare, raising `ChecksumMismatch` that names the sender, the first bad
message's round, tensors, boxes and both rows. Each table sent carries one row more, the
sender's word on the link (`link_agreement`), which both ends keep with their group.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from refitplane.errors import ChecksumMismatch
from refitplane.reshard.boxes import format_box
from refitplane.reshard.link_agreement import FULL_PATH, agreed_after
from refitplane.reshard.schedule import Message
from refitplane.reshard.transport.base import Handle, P2POp

if TYPE_CHECKING:
    from refitplane.reshard.op_group import Link
    from refitplane.reshard.transport.base import Transport


@dataclass(frozen=True)
class TableExchange:
    """The tables' swap, posted (`RunChecksums.exchange`): its completion handle (None
    where the rank has no link) and the buffers the senders' tables arrive in."""

    handle: Handle | None
    remote: dict[Link, torch.Tensor]


class RunChecksums:
    """The tables of `rank`'s links (`messages_per_link`: none where verification is off);
    `never_pays`: this rank, as a sender, tells its receivers that no delta can win on its
    links (`delta_cost.never_pays`), so the next refit's delta links run the full path."""

    def __init__(
        self,
        rank: int,
        messages_per_link: Mapping[Link, int],
        device: torch.device,
        never_pays: bool,
    ) -> None:
        self.rank = rank
        self.never_pays = never_pays
        # The rows per link that the run fills, views of the tables exchanged at the end.
        self.sums: dict[Link, torch.Tensor] = {}
        self._exchanged: dict[Link, torch.Tensor] = {}
        for link, n in messages_per_link.items():
            table = torch.zeros((n + 1, 2), dtype=torch.int64, device=device)
            if link[0] == rank and never_pays:
                table[n, 0] = FULL_PATH
            self._exchanged[link] = table
            self.sums[link] = table[:n]

    def row(self, m: Message) -> torch.Tensor:
        """Message `m`'s (S0, S1) row in its link's table."""
        return self.sums[(m.src, m.dst)][m.round]

    def exchange(self, t: Transport, deadline: float) -> TableExchange:
        """Post the tables' swap over `t` (senders send, receivers receive) on channel 0,
        ordered on the device after every channel's work: its transfers, packing,
        unpacking and checksums. Where the transport orders work on the device, the run
        posts it right after its last group, before waiting for any: it then travels
        behind the data instead of one more round trip after the host saw the last group
        complete (~1 ms of a Qwen3-8B receiver's executor on 2xH100)."""
        t.end()
        t.begin()
        ops: list[P2POp] = []
        remote: dict[Link, torch.Tensor] = {}
        for link in sorted(self._exchanged):
            src, dst = link
            if src == self.rank:
                ops.append(P2POp(True, dst, self._exchanged[link].view(-1).view(torch.uint8)))
            else:
                theirs = torch.empty_like(self._exchanged[link])
                remote[link] = theirs
                ops.append(P2POp(False, src, theirs.view(-1).view(torch.uint8)))
        handle = None
        if ops:
            with t.channel_context(0):
                handle = t.fence(t.issue(0, ops, deadline))
        return TableExchange(handle, remote)

    def verify(
        self,
        t: Transport,
        deadline: float,
        cancel: threading.Event | None,
        messages: Iterable[Message],
        tensors_total: int,
        posted: TableExchange | None = None,
    ) -> int:
        """Swap the tables over `t` (`posted`: already posted by `exchange`), keep the
        links' agreed words on `t`, and compare every received row with the sender's: how
        many received tensors verified (`tensors_total` when every message matched), else
        `ChecksumMismatch` for the first link with a bad message. `messages`: the schedule's."""
        swap = posted if posted is not None else self.exchange(t, deadline)
        if swap.handle is not None:
            t.wait(swap.handle, deadline, cancel)
        remote = swap.remote
        arrived = {link: theirs.cpu() for link, theirs in remote.items()}
        t.full_links = agreed_after(
            t.full_links, self.rank, self._exchanged, self.never_pays, arrived
        )
        mismatched = {
            link: (self.sums[link].cpu() != theirs[:-1]).any(dim=1)
            for link, theirs in arrived.items()
        }
        if not any(bool(differs.any()) for differs in mismatched.values()):
            # Every received message matched: every received tensor is verified (counting
            # them per message would cost a pass over every chunk on every refit).
            return tensors_total
        verified: set[str] = set()
        failed: set[str] = set()
        received = self._received(messages)
        for link in sorted(remote):
            bad = mismatched[link].nonzero().flatten().tolist()
            for round_index, m in enumerate(received[link]):
                names = {c.tensor for c in m.chunks}
                (failed if round_index in bad else verified).update(names)
            if bad:
                m = received[link][bad[0]]
                where = ", ".join(f"{c.tensor!r} {format_box(c.box)}" for c in m.chunks[:4])
                more = f" and {len(m.chunks) - 4} more" if len(m.chunks) > 4 else ""
                # The message's round and both rows say which message of the link it was
                # and how far apart the ends are (an all-zero row: nothing was summed).
                sent = arrived[link][bad[0]].tolist()
                got = self.sums[link][bad[0]].tolist()
                raise ChecksumMismatch(
                    f"rank {self.rank}: bytes from rank {link[0]} do not match the sender's checksum "
                    f"({len(bad)} of {len(received[link])} message(s)); first: round {m.round}, "
                    f"{where}{more} (sender's sums {sent}, received {got})"
                )
        return len(verified - failed)

    def _received(self, messages: Iterable[Message]) -> dict[Link, list[Message]]:
        """Each incoming link's messages in round order (their rows in its table)."""
        out: dict[Link, list[Message]] = {}
        for m in messages:
            if m.dst == self.rank:
                out.setdefault((m.src, m.dst), []).append(m)
        for received in out.values():
            received.sort(key=lambda m: m.round)
        return out
