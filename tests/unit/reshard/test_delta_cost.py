"""The "auto" decision against a link's rate (`delta_cost`) and the sampled estimate it is
made on before a scan (`delta_batch.sample_changed`, in Triton's interpreter on CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard import delta_cost
from refitplane.reshard.delta import Encoding
from tests.unit.reshard.interpreter import run_in_interpreter

MiB = 1 << 20
NVLINK = 360e9  # bytes/s, 2 x H100 (BENCHMARKS.md 2026-11-26)
SOCKETS = 5.77e9  # NCCL's socket transport between two H200s of one host


def _encoding(fraction: float, rate: float, *, scanned: bool = False) -> Encoding:
    nbytes = 64 * MiB
    changed = int(fraction * nbytes // 2)
    return delta_cost.choose(nbytes, changed, 2, rate, scanned=scanned).encoding


def test_nvlink_goes_dense_where_the_h100_runs_were_slower_than_full() -> None:
    # 2 x H100 over NVLink, 2026-11-26: 1 % changed 49.8 ms, 20 % 137 ms, dense 45.7 ms.
    for fraction in (0.001, 0.01, 0.05, 0.2):
        assert _encoding(fraction, NVLINK) is Encoding.DENSE, fraction
    # Once scanned (its cost sunk), a message with few changes is still worth a delta.
    assert _encoding(0.001, NVLINK, scanned=True) is Encoding.INDEX
    assert delta_cost.scan_first(64 * MiB, 2, NVLINK, 0.5) is None  # a sample decides


def test_the_network_keeps_deltas_up_to_the_fraction_rule() -> None:
    # Sockets at 5.77 GB/s, 2026-11-26: 18.4x at 1 %, 3.6x at 20 %.
    assert _encoding(0.01, SOCKETS) is Encoding.INDEX
    assert _encoding(0.2, SOCKETS) is Encoding.BITMAP
    assert _encoding(0.45, SOCKETS) is Encoding.BITMAP
    assert delta_cost.scan_first(64 * MiB, 2, SOCKETS, 0.5) is True  # no sample needed
    assert delta_cost.scan_first(64 * MiB, 2, 1e15, 0.5) is False  # nothing can win


def test_the_rate_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(delta_cost.LINK_RATE_ENV, raising=False)
    assert delta_cost.link_rate_setting() is None
    monkeypatch.setenv(delta_cost.LINK_RATE_ENV, "off")
    assert delta_cost.link_rate_setting() == 0.0
    monkeypatch.setenv(delta_cost.LINK_RATE_ENV, "25")
    assert delta_cost.link_rate_setting() == 25e9
    for bad in ("-1", "fast"):
        monkeypatch.setenv(delta_cost.LINK_RATE_ENV, bad)
        with pytest.raises(InvalidArgument, match=delta_cost.LINK_RATE_ENV):
            delta_cost.link_rate_setting()


def check_sample(device: str) -> None:
    """The kernel's estimate equals the torch path's, exact where every block is sampled,
    close where a few are."""
    from refitplane.reshard import delta_batch

    g = torch.Generator().manual_seed(1)
    sizes, fractions = (3, 4096, 9000, 600_000), (1.0, 0.0, 0.3, 0.01)
    bases, currents = [], []
    for n, fraction in zip(sizes, fractions, strict=True):
        base = torch.randn(n, generator=g).to(torch.bfloat16)
        current = base.clone()
        current[torch.rand(n, generator=g) < fraction] += 1
        bases.append(base.view(torch.uint8).to(device))
        currents.append(current.view(torch.uint8).to(device))
    kernel = delta_batch.sample_changed(currents, bases, 2, budget=8)
    assert kernel == delta_batch.sample_changed(currents, bases, 2, kernel=False, budget=8)
    exact = [
        int((c.view(torch.int16) != b.view(torch.int16)).sum())
        for c, b in zip(currents, bases, strict=True)
    ]
    assert kernel[:2] == exact[:2]  # every block of the one-block messages sampled
    message, _, size = delta_batch.sample_blocks(list(sizes), budget=8)
    assert size[message == 3].sum() < sizes[3] // 2  # of the large one, a sample
    assert abs(kernel[3] - exact[3]) < 0.3 * exact[3]
    assert delta_batch.sample_changed(currents, bases, 2) == exact  # budget above the blocks


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_sampled_estimate_in_the_interpreter() -> None:
    run_in_interpreter("tests.unit.reshard.test_delta_cost", "check_sample")


def test_no_delta_beats_nvlink_but_one_may_beat_a_network_link() -> None:
    """The link decision (`never_pays`): over NVLink (360 and the 364.3 GB/s measured), even
    a message with nothing changed loses to dense once its link's exchange is paid, so the
    link runs the full path; over sockets, or without a rate, deltas stay possible."""
    assert delta_cost.never_pays(NVLINK)
    assert delta_cost.never_pays(364.3e9)
    assert not delta_cost.never_pays(SOCKETS)
    assert not delta_cost.never_pays(100e9)
    assert not delta_cost.never_pays(None)
    assert not delta_cost.never_pays(0.0)  # REFIT_DELTA_LINK_GBPS=off
    # A message's own decision leaves the exchange out (paid once any message is a delta):
    # at 360 GB/s a message alone may still sample; the link decision is the stricter one.
    assert delta_cost.scan_first(1 << 24, 2, NVLINK, 0.5) is None
