"""The environment a test's or the demo's `vllm serve` runs in: an inherited
`VLLM_CPU_KVCACHE_SPACE` (whole GiB per worker, filled at start) must not override the
command's `--kv-cache-memory-bytes`; `Managed` unsets a variable given as None."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from refitplane.testing.child_processes import Managed, python, vllm_server_module
from refitplane.testing.vllm_cpu import TEST_KV_CACHE_BYTES
from refitplane.testing.vllm_server import vllm_serve_command, vllm_serve_env

pytestmark = pytest.mark.unit


def test_the_command_sizes_the_kv_cache_and_the_env_drops_the_inherited_space() -> None:
    argv = vllm_serve_command(Path("/m"), 8123, tensor_parallel_size=2)
    assert argv[:3] == python("-m", vllm_server_module())[:3]
    flag = argv.index("--kv-cache-memory-bytes")
    assert argv[flag + 1] == str(TEST_KV_CACHE_BYTES)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    env = vllm_serve_env(2, {"EXTRA": "1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] is None
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["EXTRA"] == "1"


def test_a_none_in_managed_env_unsets_what_the_parent_has(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("KEPT_BY_CHILD", "yes")
    script = (
        "import os; print(os.environ.get('VLLM_CPU_KVCACHE_SPACE'), os.environ['KEPT_BY_CHILD'])"
    )
    child = Managed(
        "probe", [sys.executable, "-c", script], tmp_path / "probe.log", vllm_serve_env(1)
    )
    assert child.proc.wait(timeout=60) == 0
    child.stop()
    assert (tmp_path / "probe.log").read_text().split() == ["None", "yes"]
