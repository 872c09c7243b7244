"""The CUDA checksum kernel, checked without a GPU: it compiles for Hopper, and Triton's
interpreter runs it to the same sums as the torch reference."""

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
from refitplane.reshard import checksum as cs
kernel = cs._triton_kernel()
wpp = 8 * cs._WORDS_PER_PROGRAM  # bytes per program
sizes = (1, 7, 8, 13, 1024 * 8, wpp + 3, 3 * wpp, 0, 5 * wpp - 8, 2 * wpp + 7)
bufs = [
    torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for n in sizes
]

def reference(buf):
    out = torch.zeros(2, dtype=torch.int64)
    cs._accumulate_torch(buf, out)
    return out.tolist()

slow = [reference(b) for b in bufs]
for b, expected in zip(bufs, slow):
    table = torch.zeros((3, 2), dtype=torch.int64)
    cs._launch(kernel, [b], [table[1]])
    cs._launch(kernel, [b], [table[2]])
    cs._launch(kernel, [b], [table[2]])
    assert table[0].tolist() == [0, 0]  # only the given row is written
    assert table[1].tolist() == expected, (b.numel(), table[1].tolist(), expected)
    assert table[2].tolist() == [(2 * x + 2**63) % 2**64 - 2**63 for x in expected]  # it adds
# One launch for every buffer: each lands in its own row, whatever the sizes around it
# (partial last words included).
table = torch.zeros((len(bufs) + 1, 2), dtype=torch.int64)
cs._launch(kernel, bufs, [table[i + 1] for i in range(len(bufs))])
assert table[0].tolist() == [0, 0]
assert [table[i + 1].tolist() for i in range(len(bufs))] == slow
print("ok")
"""


def test_kernel_matches_torch_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRET],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")


def test_kernel_compiles_for_hopper() -> None:
    from refitplane.reshard import checksum as cs

    compiles_for_hopper(
        cs._triton_kernel(),
        {"tab": "*i64", "n": "i64"},
        {"BLOCK": cs._BLOCK, "ITERS": cs._ITERS, "STEPS": cs._SEARCH_STEPS},
    )
