from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from refitplane.cli.refitctl import main

pytestmark = pytest.mark.unit

LAYOUTS = Path(__file__).resolve().parents[3] / "examples" / "layouts"


def test_plan_prints_totals_links_and_hash(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan",
            "--source",
            str(LAYOUTS / "trainer_tp2_dp2.json"),
            "--target",
            str(LAYOUTS / "generator_tp4.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "plan hash" in out
    assert "imbalance" in out
    assert "source -> target" in out


def test_plan_json_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "plan",
            "--json",
            "--source",
            str(LAYOUTS / "trainer_tp2_dp2.json"),
            "--target",
            str(LAYOUTS / "generator_tp4.json"),
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert (
        summary["total_bytes"]
        == sum(summary["recv_bytes"].values())
        == sum(summary["send_bytes"].values())
    )
    assert set(summary["recv_bytes"]) == {"0", "1", "2", "3"}  # target's own numbering
    assert len(summary["plan_hash"]) == 64


def test_uncoverable_target_exits_nonzero_naming_the_tensor() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "refitplane.cli.refitctl",
            "plan",
            "--source",
            str(LAYOUTS / "trainer_tp2_dp2.json"),
            "--target",
            str(LAYOUTS / "generator_tp4_needs_lm_head.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "tensor 'lm_head.weight', rank 2" in proc.stderr
