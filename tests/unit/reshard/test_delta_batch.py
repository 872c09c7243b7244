"""The batched delta kernels (`delta_batch`: one launch per pass for many messages) write the
same payload bytes as the torch path, advance the bases, and apply exactly.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported, so in a child process); the GPU suite runs `check_batch("cuda")` compiled."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from refitplane.reshard.delta import (
    DeltaHeader,
    Encoding,
    choose_encoding,
    encode_into,
    encoded_nbytes,
)
from tests.unit.reshard.interpreter import run_in_interpreter

SIZES = (10000, 4096, 3, 9000, 50000, 4097)
FRACTIONS = (0.001, 0.3, 1.0, 0.0, 0.02, 0.6)


def check_batch(device: str) -> None:
    """Messages of several sizes and changed fractions (dense, index and bitmap; one with
    nothing changed) through `scan_many` (base advanced, the current images' checksum sums
    added where they are whole 8-byte words), `prepare_gather` (launched in three parts) and
    `apply_many`."""
    from refitplane.reshard import delta_apply, delta_batch
    from refitplane.reshard.checksum import accumulate_sums

    g = torch.Generator().manual_seed(0)
    bases, currents = [], []
    for n, fraction in zip(SIZES, FRACTIONS, strict=True):
        base = torch.randn(n, generator=g).to(torch.bfloat16)
        current = base.clone()
        current[torch.rand(n, generator=g) < fraction] += 1
        bases.append(base.view(torch.uint8))
        currents.append(current.view(torch.uint8))
    cur = [c.to(device) for c in currents]
    snapshot = [b.clone().to(device) for b in bases]
    rows = torch.full((len(cur), 2), 7, dtype=torch.int64, device=device)
    rows[:4] = 0  # rows are zeroed tables; the last two must stay untouched
    sums: list[torch.Tensor | None] = [rows[i] for i in range(len(cur) - 1)] + [None]
    batch = delta_batch.scan_many(cur, snapshot, 2, update=True, sums=sums)
    counts = [int(n) for n in batch.counts.tolist()]
    # Sizes in bytes 20000, 8192, 6, 18000, 100000, 8194: 6 is no whole word, the last has
    # no row, and the fifth's row was not zero (added to as given).
    assert batch.summed == (True, True, False, True, True, False)
    for i, c in enumerate(currents):
        want = torch.zeros(2, dtype=torch.int64)
        if batch.summed[i]:
            accumulate_sums(c, want, use_triton=False)
        if i >= 4:
            want += 7
        assert torch.equal(rows[i].cpu(), want), (i, rows[i], want)
    assert counts == [
        int((c.view(torch.int16) != b.view(torch.int16)).sum())
        for c, b in zip(currents, bases, strict=True)
    ]
    assert all(torch.equal(s.cpu(), c) for s, c in zip(snapshot, currents, strict=True))
    headers = [choose_encoding(c.numel(), n, 2) for c, n in zip(currents, counts, strict=True)]
    headers[1] = DeltaHeader(  # both sparse encodings, whatever the sizes choose
        Encoding.BITMAP,
        counts[1],
        encoded_nbytes(Encoding.BITMAP, currents[1].numel(), counts[1], 2),
    )
    # A bitmap payload of a message with nothing changed: every block of it skips the
    # gather (its flags are the zero-filled buffer's zeros).
    headers[3] = DeltaHeader(
        Encoding.BITMAP, 0, encoded_nbytes(Encoding.BITMAP, currents[3].numel(), 0, 2)
    )
    assert counts[3] == 0
    assert {h.encoding for h in headers} == set(Encoding)
    payloads = [
        None
        if h.encoding is Encoding.DENSE
        else torch.zeros(h.nbytes, dtype=torch.uint8, device=device)
        for h in headers
    ]
    gather = delta_batch.prepare_gather(batch, headers, payloads)
    assert gather is not None
    for first, end in ((0, 2), (2, 5), (5, 6)):  # as a sender sends them, part by part
        gather.launch(first, end)
    sent = [i for i, p in enumerate(payloads) if p is not None]
    for i in sent:
        want = torch.empty(headers[i].nbytes, dtype=torch.uint8)
        encode_into(currents[i], bases[i], headers[i], 2, want)
        assert torch.equal(payloads[i].cpu(), want), (i, headers[i])
    images = [bases[i].clone().to(device) for i in sent]
    # Checksum rows of the images before the apply, which the apply keeps current (the last
    # message, 8194 bytes, ends in a partial 64-bit word).
    before = torch.zeros((len(sent), 2), dtype=torch.int64)
    for row, image in zip(before, images, strict=True):
        accumulate_sums(image.cpu(), row, use_triton=False)
    kept = before.to(device)
    delta_apply.apply_many(
        images,
        [headers[i] for i in sent],
        2,
        [payloads[i] for i in sent],
        [kept[k] for k in range(len(sent))],
    )
    for k, (image, i) in enumerate(zip(images, sent, strict=True)):
        assert torch.equal(image.cpu(), currents[i]), i
        want = torch.zeros(2, dtype=torch.int64)
        accumulate_sums(currents[i], want, use_triton=False)
        assert torch.equal(kept[k].cpu(), want), (i, kept[k], want)
    assert currents[sent[-1]].numel() % 8


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize(
    ("update", "slots", "stripes"), [("words", "0", "1"), ("rows", "0", "1"), ("rows", "64", "4")]
)
def test_batched_kernels_in_the_interpreter(
    update: str, slots: str, stripes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "rows": the base advanced a row of 8 words at a time (REFIT_DELTA_SCAN_UPDATE); the
    # messages of 3 and 4097 words end inside a row, so its store must stop at their end.
    # 64 slots per block (REFIT_DELTA_PACK_CAP): the index payloads' blocks come from the
    # scan's slots through `pack`, but the 2 % message's blocks (~80 changed words each)
    # overflow them and the bitmap payload is the gather's: both kernels write one payload.
    # 4 stripes (REFIT_DELTA_SUM_STRIPES): the checksum sums spread, then folded into rows
    # that were zero and rows that were not.
    monkeypatch.setenv("REFIT_DELTA_SCAN_UPDATE", update)
    monkeypatch.setenv("REFIT_DELTA_PACK_CAP", slots)
    monkeypatch.setenv("REFIT_DELTA_SUM_STRIPES", stripes)
    run_in_interpreter("tests.unit.reshard.test_delta_batch", "check_batch")


def check_sums_every_word(device: str) -> None:
    """The scan's checksum rows equal `checksum.accumulate_sums` of the current images for
    every word size, whole blocks and a partial one, in the mode REFIT_DELTA_SCAN_SUMS
    chose ("reload" or "words", `delta_kernels.folded_sums`)."""
    from refitplane.reshard import delta_batch, delta_kernels
    from refitplane.reshard.checksum import accumulate_sums

    g = torch.Generator().manual_seed(3)
    for word in (1, 2, 4, 8):
        sizes = (8, 20000, delta_kernels.BLOCK * word + 24)
        currents = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        bases = [c.clone() for c in currents]
        bases[1][::7] ^= 1
        rows = torch.zeros((len(sizes), 2), dtype=torch.int64, device=device)
        batch = delta_batch.scan_many(
            [c.to(device) for c in currents],
            [b.to(device) for b in bases],
            word,
            update=False,
            sums=[rows[i] for i in range(len(sizes))],
        )
        assert all(batch.summed)
        for i, current in enumerate(currents):
            want = torch.zeros(2, dtype=torch.int64)
            accumulate_sums(current, want, use_triton=False)
            assert torch.equal(rows[i].cpu(), want), (word, sizes[i], rows[i], want)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize(("mode", "stripes"), [("reload", "1"), ("words", "1"), ("reload", "8")])
def test_scan_sums_in_the_interpreter(
    mode: str, stripes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 stripes: the 20000-byte messages' blocks of 4096 words land in different stripes.
    monkeypatch.setenv("REFIT_DELTA_SCAN_SUMS", mode)
    monkeypatch.setenv("REFIT_DELTA_SUM_STRIPES", stripes)
    run_in_interpreter("tests.unit.reshard.test_delta_batch", "check_sums_every_word")
