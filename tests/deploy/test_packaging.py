"""What `pip install` and PyPI see of the four distributions (the core and one per role):
the Apache-2.0 LICENSE in every sdist and wheel, the license as an SPDX expression, project
URLs and classifiers, the .proto files in the core's sdist, metadata `twine check --strict`
accepts, and a build that prints no setuptools deprecation warning (the license table and
package data used to print ~90 lines per build)."""

from __future__ import annotations

import email
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.deploy.chart_support import REPO
from tests.support.processes import run_to_end

pytestmark = pytest.mark.integration

PROJECTS = {
    "refit_plane": REPO,
    "refit_plane_coordinator": REPO / "services" / "coordinator",
    "refit_plane_trainer": REPO / "services" / "trainer",
    "refit_plane_generator": REPO / "services" / "generator",
}
# What a build of the core must not copy (the services build on their own).
_NOT_CORE = ("services/", "tests/", "benchmarks/", "examples/", "deploy/", "docs/")


def _copy_checkout(project: Path, into: Path) -> None:
    """The files of `project` a clean clone has (tracked, or untracked and not ignored):
    never the virtualenv, build trees or caches a working checkout accumulates."""
    listed = run_to_end(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=project,
        timeout_s=60,
    )
    assert listed.returncode == 0, listed.stderr
    for relative in listed.stdout.splitlines():
        if project == REPO and relative.startswith(_NOT_CORE):
            continue
        origin = project / relative
        if not origin.is_file():
            continue  # deleted in the working tree, not yet in git
        target = into / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, target)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, str]]:
    """{distribution: (sdist, wheel, the build's output)}, each built from a clean copy."""
    out: dict[str, tuple[Path, Path, str]] = {}
    script = (
        # build_meta rewrites sys.argv while it runs: read the target first.
        "import sys, setuptools.build_meta as b; d = sys.argv[1]; "
        "print(b.build_sdist(d)); print(b.build_wheel(d))"
    )
    for name, project in PROJECTS.items():
        source = tmp_path_factory.mktemp(f"src-{name}") / "project"
        _copy_checkout(project, source)
        dist = tmp_path_factory.mktemp(f"dist-{name}")
        result = run_to_end([sys.executable, "-c", script, str(dist)], cwd=source, timeout_s=300)
        assert result.returncode == 0, result.stderr[-3000:]
        (sdist,) = dist.glob("*.tar.gz")
        (wheel,) = dist.glob("*.whl")
        out[name] = (sdist, wheel, result.stdout + result.stderr)
    return out


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


@pytest.mark.parametrize("name", list(PROJECTS))
def test_license_metadata_and_urls(built, name: str) -> None:
    sdist, wheel, _ = built[name]
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.lstrip().startswith("Apache License")
    assert (PROJECTS[name] / "LICENSE").read_text() == license_text
    with zipfile.ZipFile(wheel) as archive:
        (shipped,) = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert archive.read(shipped).decode() == license_text
    with tarfile.open(sdist) as archive:
        assert any(m.name.endswith("/LICENSE") for m in archive.getmembers())
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in meta.get_all("Classifier") or ())
    assert "Typing :: Typed" in meta.get_all("Classifier")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or ())
    assert {"Homepage", "Repository", "Documentation", "Issues"} <= set(urls)


def test_the_core_sdist_carries_the_protos(built) -> None:
    sdist, _, _ = built["refit_plane"]
    with tarfile.open(sdist) as archive:
        shipped = {Path(m.name).name for m in archive.getmembers() if m.name.endswith(".proto")}
    assert shipped == {p.name for p in (REPO / "proto").rglob("*.proto")}


@pytest.mark.parametrize("name", list(PROJECTS))
def test_twine_accepts_what_pypi_would_show(built, name: str) -> None:
    """`twine check --strict`: the metadata is valid and the README renders on PyPI."""
    pytest.importorskip("twine", reason="twine (dev extra) is not installed")
    sdist, wheel, _ = built[name]
    result = run_to_end(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)]
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", list(PROJECTS))
def test_builds_print_no_deprecation_warning(built, name: str) -> None:
    output = built[name][2]
    for marker in ("SetuptoolsDeprecationWarning", "BuildBackendWarning", "is deprecated"):
        assert marker not in output, f"{name}: {marker}\n{output[-2000:]}"
