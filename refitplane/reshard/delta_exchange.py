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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from refitplane.errors import InvalidArgument, TransferError
from refitplane.reshard import delta_triton
from refitplane.reshard.boxes import box_numel, pairwise_disjoint
from refitplane.reshard.delta import (
    DeltaHeader,
    Encoding,
    apply_delta,
    choose_encoding,
    encode_scanned,
    encoded_nbytes,
    scan,
    word_size,
)
from refitplane.reshard.delta_batch import apply_many, gather_many, scan_many
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
    # Senders: the weights being sent (the base's boxes), for the tensors an in-place advance
    # of the base copies whole.
    current: LocalShards | None = None


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


def _image(io: MessageIO, m: Message, device: torch.device) -> torch.Tensor:
    """A message's bytes in one run: its memory for a direct message, else packed into a
    zeroed buffer (alignment gaps zero in both images, as in the staging slices of both
    ends: the executor zeroes a packed delta message's slice before packing)."""
    if io.direct is not None:
        return io.direct
    return pack_image(io, torch.zeros(m.nbytes, dtype=torch.uint8, device=device))


def unpack_image(io: MessageIO, image: torch.Tensor) -> None:
    """`pack_image` backwards: the message's bytes in `image` into `io`'s views."""
    if io.direct is not None:
        io.direct.copy_(image)
        return
    parts = io.parts(image)
    for index, view in zip(io.flat, io.flat_views, strict=True):
        view.copy_(parts[index])
    for chunk in io.strided:
        chunk.view.copy_(chunk.typed(parts[chunk.index]))


def unsent_tensors(messages: Iterable[Message], base: LocalShards) -> list[str] | None:
    """Whether advancing the base message by message leaves it holding exactly the version
    sent: every element `messages` send is sent once and every tensor is sent whole or not
    at all (one target replica fed from this rank's shards). Returns the tensors they do
    not send (a replicated norm another rank sends; copied whole instead), or None when an
    element goes twice (two replicas, a norm replicated on the receivers) or a tensor only
    in part."""
    held: dict[str, int] = {}
    for sv in base:
        held[sv.spec.name] = held.get(sv.spec.name, 0) + box_numel(sv.box)
    sent: dict[str, list[tuple[tuple[int, int], ...]]] = {}
    for m in messages:
        for c in m.chunks:
            sent.setdefault(c.tensor, []).append(c.box)
    for name, boxes in sent.items():
        if sum(box_numel(b) for b in boxes) != held.get(name) or not pairwise_disjoint(boxes):
            return None
    return [name for name in held if name not in sent]


def _word(m: Message, specs: Mapping[str, TensorSpec]) -> int:
    return word_size(specs[c.tensor].itemsize for c in m.chunks)


class DeltaExchange:
    """The delta messages of one rank's transfer (`messages`: keyed by `MessageKey`;
    messages that go dense are absent)."""

    def __init__(self, rank: int, links: DeltaLinks, device: torch.device) -> None:
        self.rank = rank
        self.links = links
        self.device = device
        # Senders: the base now holds the bytes this transfer sends (advanced in place while
        # encoding); valid as the next base only once the transfer completed.
        self.advanced = False
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
        """Senders: scan, choose and encode every message of a delta link (one host read of
        all the counts), and fill the header table of each link. Where the delta messages
        send each element of the base at most once (`unsent_tensors`) and the base is on this
        device, the scan also advances the base to the bytes sent (the unsent tensors copied
        whole), so no copy of the snapshot is taken after the transfer (`advanced`)."""
        delta_sends = [(m, io) for m, io in sends if self.is_delta_link(m)]
        if not delta_sends:
            return
        rows: dict[int, list[list[int]]] = {}
        base = self.links.base
        if base is None:
            # The base was lost (a failed transfer after an advance, a restart): every message
            # goes dense, which every receiver takes as it would a full refit.
            for m, _ in delta_sends:
                rows.setdefault(m.dst, []).append([m.round, int(Encoding.DENSE), -1])
            self._tables(rows)
            return
        base_device = next(iter(base)).tensor.device  # the snapshot's: device or host
        unsent = unsent_tensors((m for m, _ in delta_sends), base)
        current_shards = self.links.current
        self.advanced = (
            base_device == self.device
            and unsent is not None
            and (current_shards is not None or not unsent)
        )
        todo: list[tuple[Message, torch.Tensor, torch.Tensor, int]] = []
        base_ios: list[MessageIO] = []
        for m, io in delta_sends:
            base_io = message_io(m, [base.view(c.tensor, c.box) for c in m.chunks], specs)
            base_ios.append(base_io)
            current, old = _image(io, m, self.device), _image(base_io, m, base_device)
            if old.device != current.device:  # a host-side snapshot
                old = old.to(current.device)
            todo.append((m, current, old, _word(m, specs)))
        counts, encode = self._scan(todo)
        if self.advanced:
            for (_, current, _, _), base_io in zip(todo, base_ios, strict=True):
                if base_io.direct is None:
                    unpack_image(base_io, current)  # a packed message's base is a copy
            if unsent and current_shards is not None:
                names = set(unsent)
                for sv in base:
                    if sv.spec.name in names:
                        sv.tensor.copy_(current_shards.view(sv.spec.name, sv.box))
        headers: list[DeltaHeader] = []
        for (m, _, _, word), n in zip(todo, counts, strict=True):
            header = choose_encoding(m.nbytes, n, word)
            if self.links.mode == "auto" and n > self.links.max_changed * (m.nbytes // word):
                header = DeltaHeader(Encoding.DENSE, n, m.nbytes)
            rows.setdefault(m.dst, []).append([m.round, int(header.encoding), n])
            headers.append(header)
        # One zero-filled buffer for every payload (alignment gaps zero: the same bytes on
        # every device), each starting at a multiple of 16 bytes.
        offsets, total = [], 0
        for header in headers:
            offsets.append(total)
            if header.encoding is not Encoding.DENSE:
                total += (header.nbytes + 15) // 16 * 16
        arena = torch.zeros(total, dtype=torch.uint8, device=self.device)
        payloads: list[torch.Tensor | None] = [
            None if h.encoding is Encoding.DENSE else arena[at : at + h.nbytes]
            for h, at in zip(headers, offsets, strict=True)
        ]
        encode(headers, payloads)
        for (m, _, _, word), header, payload in zip(todo, headers, payloads, strict=True):
            if payload is not None:
                self.messages[(m.src, m.dst, m.round)] = DeltaMessage(header, word, payload)
        self._tables(rows)

    def _scan(
        self, todo: list[tuple[Message, torch.Tensor, torch.Tensor, int]]
    ) -> tuple[list[int], Callable[[list[DeltaHeader], list[torch.Tensor | None]], None]]:
        """Count every message's changed words (one host read) and return them with the
        function that writes the payloads: on CUDA one launch per pass for all messages of a
        word size (`delta_batch`), else message by message (`delta.scan`)."""
        if todo and delta_triton.available(todo[0][1]):
            by_word: dict[int, list[int]] = {}
            for i, (_, _, _, word) in enumerate(todo):
                by_word.setdefault(word, []).append(i)
            batches = {
                word: scan_many(
                    [todo[i][1] for i in chosen],
                    [todo[i][2] for i in chosen],
                    word,
                    update=self.advanced,
                )
                for word, chosen in by_word.items()
            }
            found = torch.cat([batches[w].counts for w in by_word]).tolist()
            counts = [0] * len(todo)
            for i, n in zip([i for chosen in by_word.values() for i in chosen], found, strict=True):
                counts[i] = int(n)

            def gather(headers: list[DeltaHeader], payloads: list[torch.Tensor | None]) -> None:
                for word, chosen in by_word.items():
                    gather_many(
                        batches[word], [headers[i] for i in chosen], [payloads[i] for i in chosen]
                    )

            return counts, gather
        scans = [scan(cur, old, word, update_base=self.advanced) for _, cur, old, word in todo]
        counts = [int(n) for n in torch.stack([f.count for f in scans]).tolist()] if scans else []

        def encode(headers: list[DeltaHeader], payloads: list[torch.Tensor | None]) -> None:
            for (_, cur, _, word), found, header, payload in zip(
                todo, scans, headers, payloads, strict=True
            ):
                if payload is not None:
                    encode_scanned(cur, found, header, word, payload)

        return counts, encode

    def _tables(self, rows: Mapping[int, list[list[int]]]) -> None:
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

    @staticmethod
    def apply_all(received: list[tuple[torch.Tensor, DeltaMessage]]) -> None:
        """Apply a completed group's deltas: on CUDA one launch per pass for all of them
        of a word size (`delta_batch.apply_many`), else one by one."""
        if not received:
            return
        if not delta_triton.available(received[0][0]):
            for image, delta in received:
                apply_delta(image, delta.header, delta.word, delta.payload)
            return
        by_word: dict[int, list[tuple[torch.Tensor, DeltaMessage]]] = {}
        for image, delta in received:
            if delta.payload.numel() != delta.header.nbytes:
                raise InvalidArgument(
                    f"payload of {delta.payload.numel()} bytes, header says {delta.header.nbytes}"
                )
            by_word.setdefault(delta.word, []).append((image, delta))
        for word, items in by_word.items():
            apply_many(
                [image for image, _ in items],
                [d.header for _, d in items],
                word,
                [d.payload for _, d in items],
            )
