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


def _plan_args(*extra: str, target: str = "generator_tp4.json") -> list[str]:
    return [
        "plan",
        "--source",
        str(LAYOUTS / "trainer_tp2_dp2.json"),
        "--target",
        str(LAYOUTS / target),
        *extra,
    ]


def _refitctl(args: list[str]) -> subprocess.CompletedProcess[str]:
    """refitctl as a process: exit codes and stderr as a user sees them."""
    return subprocess.run(
        [sys.executable, "-m", "refitplane.cli.refitctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_uncoverable_target_exits_nonzero_naming_the_tensor() -> None:
    proc = _refitctl(_plan_args(target="generator_tp4_needs_lm_head.json"))
    assert proc.returncode == 2
    assert "tensor 'lm_head.weight', rank 2" in proc.stderr


def _placement(tmp_path: Path, source: list[dict[str, str]], target: list[dict[str, str]]) -> str:
    path = tmp_path / f"placement-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"source": source, "target": target}))
    return str(path)


def _plan_json(capsys: pytest.CaptureFixture[str], placement: str) -> dict[str, object]:
    assert main(_plan_args("--json", "--placement", placement)) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_plan_shows_the_transport_per_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Trainer rank r and vLLM rank r share GPU r of one node (colocated).
    gpus = [{"device": "cuda:0", "node": "n1", "gpu": f"GPU-{r}"} for r in range(4)]
    colocated = _placement(tmp_path, gpus, gpus)
    summary = _plan_json(capsys, colocated)
    assert summary["backend"] == "CUDA_IPC"
    links = summary["link_bytes"]
    assert isinstance(links, list)
    for link in links:
        assert link["transport"] == "CUDA_IPC"
        same_gpu = link["source_rank"] == link["target_rank"]
        # Alone, a cross-GPU link would take NCCL (auto); the shared GPUs rule NCCL out.
        assert link["link_choice"] == ("CUDA_IPC" if same_gpu else "NCCL")
    # vLLM on a second node: NCCL everywhere.
    other = [{"device": "cuda:0", "node": "n2", "gpu": f"GPU-x{r}"} for r in range(4)]
    assert _plan_json(capsys, _placement(tmp_path, gpus, other))["backend"] == "NCCL"
    assert main(_plan_args("--placement", colocated)) == 0
    assert "group backend CUDA_IPC" in capsys.readouterr().out


def test_placement_with_the_wrong_rank_count_names_the_side(tmp_path: Path) -> None:
    gpus = [{"device": "cuda:0", "node": "n1", "gpu": "GPU-0"}]
    proc = _refitctl(_plan_args("--placement", _placement(tmp_path, gpus, gpus)))
    assert proc.returncode != 0
    assert "'source' must list 4 rank(s)" in proc.stderr
