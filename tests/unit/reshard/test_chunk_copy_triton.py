"""The pack/unpack kernel (`chunk_copy.py`), checked without a GPU: Triton's interpreter
runs it over a table of chunks (partial last words, empty chunks, chunks spanning several
programs) to the same bytes as plain copies, in both directions."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.unit.reshard.triton_hopper import compiles_for_hopper

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

_INTERPRET = """
import torch
from refitplane.reshard import chunk_copy as cc
per_program = cc._BYTES_PER_PROGRAM
sizes = (8, 13, 0, 1, per_program + 5, 2 * per_program, 3 * per_program - 8, 24)
gen = torch.Generator().manual_seed(5)
sources = [torch.randint(0, 256, (n + 8,), dtype=torch.uint8, generator=gen)[8:] for n in sizes]
offsets, end = [], 0
for n in sizes:
    offsets.append(end)
    end = (end + n + 15) // 16 * 16
buf = torch.full((end + 64,), 0xA5, dtype=torch.uint8)[:end]
(table,) = cc.build_tables([(sources, offsets)], torch.device("cpu"))
cc.launch(table, buf, scatter=False)
for src, off in zip(sources, offsets):
    assert torch.equal(buf[off : off + src.numel()], src), (src.numel(), off)
gaps = torch.ones(end, dtype=torch.bool)
for src, off in zip(sources, offsets):
    gaps[off : off + src.numel()] = False
assert bool((buf[gaps] == 0xA5).all())  # nothing outside the chunks is written
# Whole words back to back: the pack adds the message's checksum sums as it copies.
from refitplane.reshard import checksum as cs
words = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (8, 3 * per_program, 16, 0, 24)]
at = [0]
for w in words[:-1]:
    at.append(at[-1] + w.numel())
(whole,) = cc.build_tables([(words, at)], torch.device("cpu"))
assert whole.whole_words and not table.whole_words
message = torch.zeros(at[-1] + words[-1].numel(), dtype=torch.uint8)
sums = torch.tensor([5, 7], dtype=torch.int64)
cc.launch(whole, message, scatter=False, sums=sums)
assert torch.equal(message, torch.cat(words))
expected = torch.tensor([5, 7], dtype=torch.int64)
cs._accumulate_torch(message, expected)
assert sums.tolist() == expected.tolist(), (sums.tolist(), expected.tolist())
targets = [torch.zeros(n + 8, dtype=torch.uint8)[8:] for n in sizes]
(back,) = cc.build_tables([(targets, offsets)], torch.device("cpu"))
cc.launch(back, buf, scatter=True)
for src, dst in zip(sources, targets):
    assert torch.equal(src, dst), src.numel()
print("ok")
"""


def test_kernel_packs_and_unpacks_exactly_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRET], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.parametrize(("scatter", "sums"), [(False, False), (False, True), (True, False)])
def test_kernel_compiles_for_hopper(scatter: bool, sums: bool) -> None:
    from refitplane.reshard import chunk_copy as cc

    compiles_for_hopper(
        cc.triton_kernel(),
        {"tab": "*i64", "n": "i32", "buf": "*u8", "out": "*i64"},
        {
            "SCATTER": scatter,
            "SUMS": sums,
            "BLOCK": cc._BLOCK,
            "ITERS": cc._ITERS,
            "STEPS": cc._SEARCH_STEPS,
        },
    )
