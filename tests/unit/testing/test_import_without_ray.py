"""`worker_probes.import_without_ray`: vLLM 0.26's ipc engine module imports Ray at its top
(for the trainer's Ray send mode); the benchmark's baseline imports it without Ray, and any
use of Ray then fails naming it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from refitplane.testing.refit_world.worker_probes import import_without_ray

pytestmark = pytest.mark.skipif("ray" in sys.modules, reason="Ray is imported here")


def test_a_module_that_imports_ray_loads_and_ray_stays_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "uses_ray_at_top.py").write_text(
        "import ray\n\ndef receive():\n    return 'received'\n\ndef send():\n    return ray.get(1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        pytest.skip("Ray is installed here: nothing stands in")
    module = import_without_ray("uses_ray_at_top")
    assert module.receive() == "received"
    assert "ray" not in sys.modules
    with pytest.raises(RuntimeError, match=r"ray\.get: Ray is not installed"):
        module.send()
    sys.modules.pop("uses_ray_at_top", None)


def test_another_missing_module_is_not_papered_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "uses_missing_at_top.py").write_text("import refitplane_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="refitplane_no_such_module"):
        import_without_ray("uses_missing_at_top")
