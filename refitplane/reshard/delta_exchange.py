"""The delta side of one transfer: which messages go as deltas, their headers and payloads.

Before the first message moves, every sender of a delta link compares each message it
sends on the link with the same boxes of its base (`DeltaSnapshot`, the bytes of its last
complete send, which the coordinator knows the receiver holds), picks the message's
encoding (`delta.choose_encoding`; in "auto" mode a message with more than
`max_changed` of its words changed goes dense) and encodes the payload. Then each delta
link exchanges one header table (per message: encoding, changed words), so both ends
know every payload's size before the executor posts it. Everything that allocates
happens here, before the posting loop (see `executor.py`). On CUDA the payloads are
written after the counts are read, in parts in send order (`launch_payloads`), and each
part's sends wait for it on the device, so the transfer and the receiver's applies start
while later payloads are still being written; the sender's checksum sums come from the
scan and a receiver's from a pass before the headers arrive, kept current by its applies
(`presum`), so neither end reads its images again after the transfer.

In the loop only the buffer on the wire changes: a sender still packs and checksums the
message's full current bytes, but sends the payload; a receiver first packs its current
bytes (the base) into the message's staging slice (or, for a direct message, uses the
parameter memory itself), receives the payload beside it and applies it in place before
unpacking and checksumming. So the per-message checksums compare the full current bytes
of both ends: the end state is verified, not the delta.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from refitplane.errors import InvalidArgument, TransferError
from refitplane.reshard import delta_cost, delta_triton
from refitplane.reshard.checksum import accumulate_sums_many
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
from refitplane.reshard.delta_batch import Gather, prepare_gather, scan_many
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

# Launches a sender's gather is cut into (`DeltaExchange.launch_payloads`).
GATHER_PARTS = 8
# (src, dst): one direction between two ranks, as the executor's checksum tables key it.
Direction = tuple[int, int]


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
    # Senders in "auto" mode: the link rate (bytes/s) a delta must beat (`delta_cost`: a
    # message that cannot goes dense, unscanned where a sample tells); None or 0: the
    # fraction rule alone (`max_changed`).
    link_bytes_per_s: float | None = None


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
    # Receivers on CUDA: the message's checksum row, holding its image's sums from before
    # the transfer, which the apply keeps current (`presum`).
    sums: torch.Tensor | None = None


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
        # The delta messages whose checksum sums are taken care of: senders' by the scan
        # (`encode`'s `sums`), receivers' by `presum` and the applies.
        self.summed: set[MessageKey] = set()
        # Senders on CUDA: the gathers to launch in parts, the delta messages in send order
        # with their blocks, and per part an event after its launches (`launch_payloads`).
        self._gathers: list[tuple[list[int], Gather]] = []
        self._order: list[MessageKey] = []
        self._blocks: list[int] = []
        self._written: list[torch.cuda.Event] = []
        self._part_of: dict[MessageKey, int] = {}
        # Receivers: the sums of their in-place images before the transfer (`presum`).
        self._presums: torch.Tensor | None = None
        self._presummed: dict[MessageKey, int] = {}
        self._sums: Mapping[Direction, torch.Tensor] = {}
        self._rows_ready: torch.cuda.Event | None = None
        # Senders advancing their base: (base image, current image) of the messages that go
        # dense unscanned, copied behind the payloads' launches (`launch_payloads`).
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def is_delta_link(self, m: Message) -> bool:
        peer = m.dst if m.src == self.rank else m.src
        return peer in self.links.peers

    def encode(
        self,
        sends: Iterable[tuple[Message, MessageIO]],
        specs: Mapping[str, TensorSpec],
        sums: Callable[[Message], torch.Tensor] | None = None,
    ) -> None:
        """Senders: scan, choose and encode every message of a delta link (one host read of
        all the counts), and fill the header table of each link. Where the delta messages
        send each element of the base at most once (`unsent_tensors`) and the base is on this
        device, the scan also advances the base to the bytes sent (the unsent tensors copied
        whole), so no copy of the snapshot is taken after the transfer (`advanced`). With
        `sums` (a message's zeroed checksum row), the scan on CUDA also adds each delta
        message's checksum sums of its current bytes into its row (`summed`: the executor
        then does not read those bytes again)."""
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
        every, self._arena = images(views, delta_sends, base_device, self.device, specs)
        rate = self.links.link_bytes_per_s if self.links.mode == "auto" else None
        scanned = delta_cost.to_scan(every, rate, self.links.max_changed)
        todo = [every[i] for i in scanned]
        delta_sends = [delta_sends[i] for i in scanned]
        counts, encode, summed = self._scan(todo, sums)
        if self.advanced:
            base_ios = [views.ios[(m.src, m.dst, m.round)] for m, _, _, _ in every]
            advance(views, self._arena, every, base_ios)  # staged base images are copies
            # Messages that go dense unscanned: their base images (the snapshot's own
            # memory where direct) take the current bytes, while the transfer runs.
            chosen = set(scanned)
            self._copies = [
                (old, current)
                for i, ((_, current, old, _), io) in enumerate(zip(every, base_ios, strict=True))
                if i not in chosen and io.direct is not None
            ]
            if unsent and current_shards is not None:
                names = set(unsent)
                for sv in base:
                    if sv.spec.name in names:
                        sv.tensor.copy_(current_shards.view(sv.spec.name, sv.box))
        headers = [
            self._choose(m.nbytes, n, word) for (m, _, _, word), n in zip(todo, counts, strict=True)
        ]
        # The header rows in send order (a receiver checks each row's message), unscanned
        # messages dense.
        found = dict(zip(scanned, zip(headers, counts, strict=True), strict=True))
        for i, (m, _, _, _) in enumerate(every):
            header, n = found.get(i, (DeltaHeader(Encoding.DENSE, -1, m.nbytes), -1))
            rows.setdefault(m.dst, []).append([m.round, int(header.encoding), n])
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
        for (m, current, _, word), header, payload, (_, io), was_summed in zip(
            todo, headers, payloads, delta_sends, summed, strict=True
        ):
            key = (m.src, m.dst, m.round)
            if payload is not None:
                image = current if io.direct is None else None
                self.messages[key] = DeltaMessage(header, word, payload, image=image)
                if was_summed:
                    self.summed.add(key)
            elif was_summed and sums is not None:
                # A message that goes dense is checksummed as it travels (a staged one's
                # alignment gaps as its staging slice holds them): its row starts again.
                sums(m).zero_()
        self._tables(rows)

    def _choose(self, nbytes: int, changed: int, word: int) -> DeltaHeader:
        """A scanned message's encoding: the smallest, dense above `max_changed` in "auto"
        mode, and there, with a link rate, a delta only where it beats dense on that link
        (`delta_cost.choose`, the scan's cost sunk)."""
        header = choose_encoding(nbytes, changed, word)
        if self.links.mode != "auto":
            return header
        if changed > self.links.max_changed * (nbytes // word):
            return DeltaHeader(Encoding.DENSE, changed, nbytes)
        rate = self.links.link_bytes_per_s
        if rate:
            return delta_cost.choose(nbytes, changed, word, rate, scanned=True)
        return header

    def _scan(
        self,
        todo: list[tuple[Message, torch.Tensor, torch.Tensor, int]],
        sums: Callable[[Message], torch.Tensor] | None,
    ) -> tuple[
        list[int], Callable[[list[DeltaHeader], list[torch.Tensor | None]], None], list[bool]
    ]:
        """Count every message's changed words (one host read) and return them with the
        function that writes the payloads, and which messages' checksum sums the scan added:
        on CUDA one launch per pass for all messages of a word size (`delta_batch`), else
        message by message (`delta.scan`; nothing summed)."""
        summed = [False] * len(todo)
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
                    sums=[sums(todo[i][0]) for i in chosen] if sums is not None else None,
                )
                for word, chosen in by_word.items()
            }
            found = torch.cat([batches[w].counts for w in by_word]).tolist()
            counts = [0] * len(todo)
            for i, n in zip([i for chosen in by_word.values() for i in chosen], found, strict=True):
                counts[i] = int(n)
            for word, chosen in by_word.items():
                for i, was_summed in zip(chosen, batches[word].summed, strict=True):
                    summed[i] = was_summed

            def gather(headers: list[DeltaHeader], payloads: list[torch.Tensor | None]) -> None:
                # The tables now; the launches in parts behind the header tables
                # (`launch_payloads`), so the first payloads go out while later ones are
                # written.
                self._blocks = [0] * len(todo)
                for word, chosen in by_word.items():
                    batch = batches[word]
                    found = prepare_gather(
                        batch, [headers[i] for i in chosen], [payloads[i] for i in chosen]
                    )
                    if found is not None:
                        self._gathers.append((chosen, found))
                    for i, n in zip(chosen, batch.blocks.per_message, strict=True):
                        self._blocks[i] = n
                self._order = [(m.src, m.dst, m.round) for m, *_ in todo]

            return counts, gather, summed
        scans = [scan(cur, old, word, update_base=self.advanced) for _, cur, old, word in todo]
        counts = [int(n) for n in torch.stack([f.count for f in scans]).tolist()] if scans else []

        def encode(headers: list[DeltaHeader], payloads: list[torch.Tensor | None]) -> None:
            for (_, cur, _, word), found, header, payload in zip(
                todo, scans, headers, payloads, strict=True
            ):
                if payload is not None:
                    encode_scanned(cur, found, header, word, payload)

        return counts, encode, summed

    def launch_payloads(self, parts: int = GATHER_PARTS) -> None:
        """Senders on CUDA: write the delta payloads, in `parts` launches of about equal
        work in the order the messages are sent, each followed by an event; a channel's
        sends of a part's messages wait for its event on the device (`before_send`), not
        the host, so the first payloads travel (and are applied) while later ones are
        still being gathered. Then the copies that advance the base of the messages that go
        dense unscanned (after the gathers on the stream: the sends do not wait for them)."""
        self._launch_gathers(parts)
        if self._copies:
            bases, currents = zip(*self._copies, strict=True)
            torch._foreach_copy_(list(bases), list(currents))
            self._copies = []

    def _launch_gathers(self, parts: int) -> None:
        if not self._gathers:
            return
        n, total = len(self._order), sum(self._blocks)
        bounds, done = [0], 0
        for i, blocks in enumerate(self._blocks):
            done += blocks
            if done * parts >= len(bounds) * total and i + 1 < n:
                bounds.append(i + 1)
        bounds.append(n)
        on_cuda = self.device.type == "cuda"  # (else Triton's interpreter: tests)
        for part, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            for chosen, found in self._gathers:
                found.launch(bisect.bisect_left(chosen, lo), bisect.bisect_left(chosen, hi))
            if not on_cuda:
                continue
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self._written.append(event)
            for key in self._order[lo:hi]:
                if key in self.messages:
                    self._part_of[key] = part

    def before_send(self, messages: Iterable[Message]) -> None:
        """Senders: order the current stream (a channel's, before it posts `messages`)
        after the launches that write their payloads (`launch_payloads`)."""
        if not self._written:
            return
        last = max((self._part_of.get((m.src, m.dst, m.round), -1) for m in messages), default=-1)
        if last >= 0:
            torch.cuda.current_stream(self.device).wait_event(self._written[last])

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

    def presum(
        self, recvs: Iterable[tuple[Message, MessageIO]], sums: Mapping[Direction, torch.Tensor]
    ) -> None:
        """Receivers on CUDA, before the header tables arrive (while the senders scan): the
        checksum sums of every message of a delta link received in place (its image is the
        parameters, holding the base a delta applies to), into a table of their own.
        `receive` moves those of the messages that come as deltas into their rows of `sums`
        (the executor's per-link checksum tables), and their applies keep them current, so
        the receiver does not read those bytes again after the transfer."""
        chosen = [
            (m, io.direct)
            for m, io in recvs
            if io.direct is not None and self.is_delta_link(m) and (m.src, m.dst) in sums
        ]
        if not chosen or not delta_triton.available(chosen[0][1]):
            return
        self._presums = torch.zeros((len(chosen), 2), dtype=torch.int64, device=self.device)
        accumulate_sums_many(
            [image for _, image in chosen], [self._presums[i] for i in range(len(chosen))]
        )
        self._presummed = {(m.src, m.dst, m.round): i for i, (m, _) in enumerate(chosen)}
        self._sums = sums

    def _adopt_presums(self) -> None:
        """The presummed messages that come as deltas: their sums into their checksum rows
        (one copy per link), and the rows onto their messages for the applies."""
        if self._presums is None:
            return
        by_link: dict[Direction, tuple[list[int], list[int]]] = {}
        for key, delta in self.messages.items():
            at = self._presummed.get(key)
            if at is None:
                continue
            link = (key[0], key[1])
            rounds, found = by_link.setdefault(link, ([], []))
            rounds.append(key[2])
            found.append(at)
            self.messages[key] = replace(delta, sums=self._sums[link][key[2]])
            self.summed.add(key)
        for link, (rounds, found) in by_link.items():
            index = torch.tensor(rounds, dtype=torch.int64).to(self.device)
            taken = torch.tensor(found, dtype=torch.int64).to(self.device)
            self._sums[link].index_copy_(0, index, self._presums[taken])
        if self.device.type == "cuda":
            # The applies (on the channels' side streams) add to these rows: after this.
            self._rows_ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._rows_ready.record(torch.cuda.current_stream(self.device))

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
            self._adopt_presums()

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
        if self._rows_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._rows_ready)
        self.room.apply(
            [(image, d.header, d.word, d.payload, d.starts, d.sums) for image, d in received]
        )
