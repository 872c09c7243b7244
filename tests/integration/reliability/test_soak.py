"""A short soak in CI (`benchmarks/soak.py` runs the long one): 20 refits back to back of the
synthetic model between real trainer and generator processes, with 1,000 more agents
registered and renewing their leases; every refit commits, generators hold the trainers'
bytes, and threads, file descriptors, memory and communicators of every process are stable
from the first sample to the last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refitplane.testing.cluster.soak import run_soak

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_twenty_refits_with_a_thousand_agents_registered(tmp_path: Path) -> None:
    report = run_soak(
        tmp_path, refits=20, crowd=1000, sample_every_s=2.0, warmup_refits=3, check_every=5
    )
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    assert report.committed == report.refits == 20
    assert report.crowd == 1000
    assert len(report.samples) >= 2
    assert not report.problems, report.problems
