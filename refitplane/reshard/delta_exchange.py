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
from refitplane.reshard.delta import (
    DeltaHeader,
    Encoding,
    apply_delta,
    choose_encoding,
    encode_scanned,
    encoded_nbytes,
    scan,
)
from refitplane.reshard.delta_apply import ApplyRoom, prefix_blocks
from refitplane.reshard.delta_batch import gather_many, scan_many
from refitplane.reshard.delta_images import (
    MessageKey,
    advance,
    base_views,
    images,
    word_of,
)
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.message_io import MessageIO
from refitplane.reshard.schedule import Message
from refitplane.reshard.shards import LocalShards


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
    # Receivers of a bitmap payload on CUDA: room for its per-block prefix sums.
    starts: torch.Tensor | None = None
    # Senders of a staged message: its current bytes, packed while encoding (alignment gaps
    # zero), which the executor checksums instead of packing them again.
    image: torch.Tensor | None = None


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
        # Receivers on CUDA: the applies' reserved tables (`receive`).
        self.room: ApplyRoom | None = None
        # Senders: the staged images' arena when one launch packed them (`delta_images`).
        self._arena: torch.Tensor | None = None

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
        views = base_views(base, delta_sends, specs)
        unsent = views.unsent
        current_shards = self.links.current
        self.advanced = (
            base_device == self.device
            and unsent is not None
            and (current_shards is not None or not unsent)
        )
        todo, self._arena = images(views, delta_sends, base_device, self.device, specs)
        counts, encode = self._scan(todo)
        if self.advanced:
            base_ios = [views.ios[(m.src, m.dst, m.round)] for m, _ in delta_sends]
            advance(views, self._arena, todo, base_ios)  # staged base images are copies
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
        for (m, current, _, word), header, payload, (_, io) in zip(
            todo, headers, payloads, delta_sends, strict=True
        ):
            if payload is not None:
                image = current if io.direct is None else None
                self.messages[(m.src, m.dst, m.round)] = DeltaMessage(
                    header, word, payload, image=image
                )
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
        """Receivers, once the header tables arrived: where each delta message's payload
        lands (one arena for all of them) and, on CUDA, the room its apply needs
        (`delta_apply.ApplyRoom`), so that applying during the transfer neither waits nor
        allocates."""
        found: list[tuple[int, Message, DeltaHeader, int]] = []
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
                word = word_of(m, specs)
                nbytes = encoded_nbytes(kind, m.nbytes, changed, word)
                if nbytes > m.nbytes:
                    raise InvalidArgument(
                        f"rank {self.rank}: delta from rank {src} for message {m.round} would be "
                        f"{nbytes} bytes, more than the message's {m.nbytes}"
                    )
                found.append((src, m, DeltaHeader(kind, changed, nbytes), word))
        if not found:
            return
        on_device = delta_triton.available(self.headers_in[found[0][0]])
        # Payloads and (bitmap payloads on CUDA) prefix sums, each at a multiple of 16 bytes.
        offsets: list[tuple[int, int]] = []
        total = 0
        for _, m, header, word in found:
            at = total
            total += (header.nbytes + 15) // 16 * 16
            starts_at = -1
            if on_device and header.encoding is Encoding.BITMAP:
                starts_at = total
                total += 8 * prefix_blocks(m.nbytes // word)
            offsets.append((at, starts_at))
        arena = torch.empty(total, dtype=torch.uint8, device=self.device)
        for (src, m, header, word), (at, starts_at) in zip(found, offsets, strict=True):
            starts = None
            if starts_at >= 0:
                blocks = prefix_blocks(m.nbytes // word)
                starts = arena[starts_at : starts_at + 8 * blocks].view(torch.int64)
            self.messages[(src, m.dst, m.round)] = DeltaMessage(
                header, word, arena[at : at + header.nbytes], starts
            )
        if on_device:
            self.room = ApplyRoom(self.device, len(found), [w for *_, w in found])

    def find(self, m: Message) -> DeltaMessage | None:
        return self.messages.get((m.src, m.dst, m.round))

    def apply_all(self, received: list[tuple[torch.Tensor, DeltaMessage]]) -> None:
        """Apply a completed group's deltas to their images: on CUDA through the transfer's
        `ApplyRoom` (launches on the current stream, no host wait), else one by one."""
        if not received:
            return
        if self.room is None:
            for image, delta in received:
                apply_delta(image, delta.header, delta.word, delta.payload)
            return
        self.room.apply([(image, d.header, d.word, d.payload, d.starts) for image, d in received])
