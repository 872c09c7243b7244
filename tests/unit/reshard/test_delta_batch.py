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
    nothing changed) through `scan_many` (base advanced), `gather_many` and `apply_many`."""
    from refitplane.reshard import delta_apply, delta_batch

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
    batch = delta_batch.scan_many(cur, snapshot, 2, update=True)
    counts = [int(n) for n in batch.counts.tolist()]
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
    assert {h.encoding for h in headers} == set(Encoding)
    payloads = [
        None
        if h.encoding is Encoding.DENSE
        else torch.zeros(h.nbytes, dtype=torch.uint8, device=device)
        for h in headers
    ]
    delta_batch.gather_many(batch, headers, payloads)
    sent = [i for i, p in enumerate(payloads) if p is not None]
    for i in sent:
        want = torch.empty(headers[i].nbytes, dtype=torch.uint8)
        encode_into(currents[i], bases[i], headers[i], 2, want)
        assert torch.equal(payloads[i].cpu(), want), (i, headers[i])
    images = [bases[i].clone().to(device) for i in sent]
    delta_apply.apply_many(images, [headers[i] for i in sent], 2, [payloads[i] for i in sent])
    for image, i in zip(images, sent, strict=True):
        assert torch.equal(image.cpu(), currents[i]), i


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_batched_kernels_in_the_interpreter() -> None:
    run_in_interpreter("tests.unit.reshard.test_delta_batch", "check_batch")
