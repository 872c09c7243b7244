"""A receiver's delta applies through one transfer's room (`delta_apply.ApplyRoom`): several
groups in turn, index and bitmap payloads, 2- and 4-byte words in one group, end exact, and
the checksum rows they keep current equal the sums of the images afterwards; a payload
pointing outside its message writes nothing there.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported, so in a child process); the GPU suite runs `check_apply("cuda")` compiled."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from refitplane.reshard.delta import DeltaHeader, Encoding, encode_into, encoded_nbytes
from tests.unit.reshard.interpreter import run_in_interpreter

# (elements, changed fraction, dtype, encoding): one group per line of GROUPS.
GROUPS = (
    ((10000, 0.001, torch.bfloat16, Encoding.INDEX), (9000, 0.3, torch.bfloat16, Encoding.BITMAP)),
    ((3, 1.0, torch.float32, Encoding.INDEX), (50000, 0.02, torch.bfloat16, Encoding.BITMAP)),
    ((4097, 0.0, torch.bfloat16, Encoding.INDEX), (20000, 0.6, torch.float32, Encoding.BITMAP)),
    ((8192, 0.05, torch.float32, Encoding.INDEX),),
    # ~9,000 values: three programs of 4,096, each through several chunks of its loop.
    ((30000, 0.3, torch.bfloat16, Encoding.INDEX),),
)


def _message(
    n: int, fraction: float, dtype: torch.dtype, encoding: Encoding, seed: int
) -> tuple[torch.Tensor, torch.Tensor, DeltaHeader, int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    current = base.clone()
    current[torch.rand(n, generator=g) < fraction] += 1
    word = base.element_size()
    old, new = base.view(torch.uint8), current.view(torch.uint8)
    changed = int((base != current).sum())
    header = DeltaHeader(encoding, changed, encoded_nbytes(encoding, old.numel(), changed, word))
    payload = torch.empty(header.nbytes, dtype=torch.uint8)
    encode_into(new, old, header, word, payload)
    return old, new, header, word, payload


def check_apply(device: str) -> None:
    from refitplane.reshard import delta_apply

    # A message's prefix sums take several steps of 4 blocks (production: 1024), so the carry
    # from step to step is exercised by messages of a few blocks.
    chunk, delta_apply._PREFIX_CHUNK = delta_apply._PREFIX_CHUNK, 4
    try:
        _check_apply(device)
    finally:
        delta_apply._PREFIX_CHUNK = chunk


def _check_apply(device: str) -> None:
    from refitplane.reshard.checksum import accumulate_sums
    from refitplane.reshard.delta_apply import ApplyRoom, prefix_blocks

    messages = [
        [_message(*spec, seed=10 * g + i) for i, spec in enumerate(group)]
        for g, group in enumerate(GROUPS)
    ]
    words = [word for group in messages for *_, word, _ in group]
    room = ApplyRoom(torch.device(device), sum(len(g) for g in messages), words)
    images, rows = [], []
    for group in messages:
        items = []
        for old, _, header, word, payload in group:
            image = old.clone().to(device)
            starts = None
            if header.encoding is Encoding.BITMAP:
                blocks = prefix_blocks(image.numel() // word)
                starts = torch.empty(blocks, dtype=torch.int64, device=device)
            # The image's sums before (the receiver's pre-transfer pass), kept current.
            row = torch.zeros(2, dtype=torch.int64)
            accumulate_sums(old, row, use_triton=False)
            row = row.to(device)
            items.append((image, header, word, payload.to(device), starts, row))
            images.append(image)
            rows.append(row)
        room.apply(items)
    expected = [new for group in messages for _, new, *_ in group]
    for i, (image, new, row) in enumerate(zip(images, expected, rows, strict=True)):
        assert torch.equal(image.cpu(), new), i
        want = torch.zeros(2, dtype=torch.int64)
        accumulate_sums(new, want, use_triton=False)
        assert torch.equal(row.cpu(), want), (i, row, want)

    # An index past the message's end is dropped: nothing outside the image changes.
    arena = torch.zeros(4096, dtype=torch.int16, device=device)
    image = arena[1024:2048].view(torch.uint8)
    header = DeltaHeader(Encoding.INDEX, 2, encoded_nbytes(Encoding.INDEX, image.numel(), 2, 2))
    payload = torch.zeros(header.nbytes, dtype=torch.uint8)
    payload[:8].view(torch.int32).copy_(torch.tensor([3, 1500], dtype=torch.int32))
    payload[8:].view(torch.int16).fill_(7)
    row = torch.zeros(2, dtype=torch.int64, device=device)
    ApplyRoom(torch.device(device), 1, [2]).apply(
        [(image, header, 2, payload.to(device), None, row)]
    )
    assert int(arena[1024 + 3]) == 7
    assert int(arena.count_nonzero()) == 1
    # Only the word written counts: 7 in the fourth 16-bit lane of the first 64-bit word.
    assert row.tolist() == [7 << 48, 0]


def test_a_dense_message_is_not_applied() -> None:
    from refitplane.errors import InvalidArgument
    from refitplane.reshard.delta_apply import ApplyRoom

    room = ApplyRoom.__new__(ApplyRoom)  # no kernels needed to refuse it
    dense = DeltaHeader(Encoding.DENSE, 1, 8)
    with pytest.raises(InvalidArgument, match="dense"):
        room.apply([(torch.zeros(8, dtype=torch.uint8), dense, 2, torch.zeros(8), None, None)])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_applies_through_one_room_in_the_interpreter() -> None:
    run_in_interpreter("tests.unit.reshard.test_delta_apply", "check_apply")
