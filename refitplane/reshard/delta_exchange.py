"""The delta side of one transfer: which messages go as deltas, their headers and payloads.

Before the first message moves, every sender of a delta link compares each message it
sends on the link with the same boxes of its base (`DeltaSnapshot`, the bytes of its last
complete send, which the coordinator knows the receiver holds), picks the message's
encoding (`delta.choose_encoding`; in "auto" mode a message with more than
`max_changed` of its words changed goes dense) and encodes the payload. Then each delta
link exchanges one header table (per message: encoding, changed words), so both ends
know every payload's size before the executor posts it. Everything that allocates
happens here, before the posting loop (see `executor.py`).

In the loop only the buffer on the wire changes: a sender still packs and checksums the
message's full current bytes, but sends the payload; a receiver first packs its current
bytes (the base) into the message's staging slice (or, for a direct message, uses the
parameter memory itself), receives the payload beside it and applies it in place before
unpacking and checksumming. So the per-message checksums compare the full current bytes
of both ends: the end state is verified, not the delta.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from refitplane.errors import InvalidArgument, TransferError
from refitplane.reshard.delta import (
    DeltaHeader,
    Encoding,
    apply_delta,
    changed_words,
    choose_encoding,
    encode_into,
    encoded_nbytes,
    word_size,
)
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.message_io import MessageIO, message_io
from refitplane.reshard.schedule import Message
from refitplane.reshard.shards import LocalShards

# (src, dst, round): a message's identity within one refit.
MessageKey = tuple[int, int, int]


@dataclass(frozen=True)
class DeltaLinks:
    """What the coordinator decided for this rank: the peers it exchanges deltas with, and
    (senders) the base registry those deltas are computed against."""

    peers: frozenset[int]
    base: LocalShards | None
    mode: str = "auto"
    max_changed: float = 0.5


@dataclass(frozen=True, slots=True)
class DeltaMessage:
    header: DeltaHeader
    word: int
    # Senders: the encoded payload. Receivers: where the payload lands.
    payload: torch.Tensor


def pack_image(io: MessageIO, out: torch.Tensor) -> torch.Tensor:
    """A message's bytes as they travel (its chunks at their offsets, gaps as `out` holds
    them) in `out`; a direct message's memory is its image already."""
    if io.direct is not None:
        return io.direct
    parts = io.parts(out)
    for index, view in zip(io.flat, io.flat_views, strict=True):
        parts[index].copy_(view)
    for chunk in io.strided:
        chunk.typed(parts[chunk.index]).copy_(chunk.view)
    return out


def _word(m: Message, specs: Mapping[str, TensorSpec]) -> int:
    return word_size(specs[c.tensor].itemsize for c in m.chunks)


class DeltaExchange:
    """The delta messages of one rank's transfer (`messages`: keyed by `MessageKey`;
    messages that go dense are absent)."""

    def __init__(self, rank: int, links: DeltaLinks, device: torch.device) -> None:
        self.rank = rank
        self.links = links
        self.device = device
        self.messages: dict[MessageKey, DeltaMessage] = {}
        self.headers_out: dict[int, torch.Tensor] = {}
        self.headers_in: dict[int, torch.Tensor] = {}
        self._recv_order: dict[int, list[Message]] = {}

    def is_delta_link(self, m: Message) -> bool:
        peer = m.dst if m.src == self.rank else m.src
        return peer in self.links.peers

    def encode(
        self, sends: Iterable[tuple[Message, MessageIO]], specs: Mapping[str, TensorSpec]
    ) -> None:
        """Senders: count, choose and encode every message of a delta link (one host read
        of all the counts), and fill the header table of each link."""
        delta_sends = [(m, io) for m, io in sends if self.is_delta_link(m)]
        if not delta_sends:
            return
        base = self.links.base
        if base is None:
            raise TransferError(f"rank {self.rank} is to send deltas but holds no delta base")
        todo: list[tuple[Message, torch.Tensor, torch.Tensor, int]] = []
        counts: list[torch.Tensor] = []
        base_device = next(iter(base)).tensor.device  # the snapshot's: device or host
        for m, io in delta_sends:
            word = _word(m, specs)
            # Alignment gaps are zero in both images, as in the staging slices of both
            # ends (the executor zeroes a packed delta message's slice before packing).
            current = pack_image(io, torch.zeros(m.nbytes, dtype=torch.uint8, device=self.device))
            base_io = message_io(m, [base.view(c.tensor, c.box) for c in m.chunks], specs)
            old = pack_image(base_io, torch.zeros(m.nbytes, dtype=torch.uint8, device=base_device))
            if old.device != current.device:  # a host-side snapshot
                old = old.to(current.device)
            todo.append((m, current, old, word))
            counts.append(changed_words(current, old, word))
        changed = torch.stack(counts).tolist() if counts else []
        rows: dict[int, list[list[int]]] = {}
        for (m, current, old, word), n in zip(todo, changed, strict=True):
            header = choose_encoding(m.nbytes, int(n), word)
            if self.links.mode == "auto" and int(n) > self.links.max_changed * (m.nbytes // word):
                header = DeltaHeader(Encoding.DENSE, int(n), m.nbytes)
            rows.setdefault(m.dst, []).append([m.round, int(header.encoding), int(n)])
            if header.encoding is Encoding.DENSE:
                continue
            payload = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
            encode_into(current, old, header, word, payload)
            self.messages[(m.src, m.dst, m.round)] = DeltaMessage(header, word, payload)
        for dst, table in rows.items():
            self.headers_out[dst] = torch.tensor(table, dtype=torch.int64, device=self.device)

    def expect(self, recvs: Iterable[Message]) -> None:
        """Receivers: a header table buffer per delta link (its message count known from
        the schedule)."""
        for m in recvs:
            if self.is_delta_link(m):
                self._recv_order.setdefault(m.src, []).append(m)
        for src, messages in self._recv_order.items():
            self.headers_in[src] = torch.empty(
                (len(messages), 3), dtype=torch.int64, device=self.device
            )

    def receive(self, specs: Mapping[str, TensorSpec]) -> None:
        """Receivers, once the header tables arrived: a payload buffer per delta message."""
        for src, table in self.headers_in.items():
            messages = self._recv_order[src]
            for (round_index, encoding, changed), m in zip(
                table.cpu().tolist(), messages, strict=True
            ):
                if round_index != m.round:
                    raise TransferError(
                        f"rank {self.rank}: delta header from rank {src} names message "
                        f"{round_index}, expected {m.round}",
                    )
                kind = Encoding(encoding)
                if kind is Encoding.DENSE:
                    continue
                word = _word(m, specs)
                nbytes = encoded_nbytes(kind, m.nbytes, changed, word)
                if nbytes > m.nbytes:
                    raise InvalidArgument(
                        f"rank {self.rank}: delta from rank {src} for message {m.round} would be "
                        f"{nbytes} bytes, more than the message's {m.nbytes}"
                    )
                payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self.messages[(src, m.dst, m.round)] = DeltaMessage(
                    DeltaHeader(kind, changed, nbytes), word, payload
                )

    def find(self, m: Message) -> DeltaMessage | None:
        return self.messages.get((m.src, m.dst, m.round))

    @staticmethod
    def apply(image: torch.Tensor, delta: DeltaMessage) -> None:
        apply_delta(image, delta.header, delta.word, delta.payload)
