"""What `pip install .` puts into the images: a wheel built from exactly the files the
Dockerfiles COPY (pyproject.toml, setup.py, refitplane/, services/), checked for the services, their
data files, the console scripts and the vLLM plugin entry point."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest

from tests.deploy.chart_support import REPO
from tests.deploy.dockerfile_support import DOCKER_DIR, parse_dockerfile, pyproject

pytestmark = pytest.mark.integration


def _copied_sources() -> list[str]:
    """Build-context paths the coordinator image copies into its build stage."""
    image = parse_dockerfile(DOCKER_DIR / "coordinator.Dockerfile")
    sources: list[str] = []
    for copy in image.of("COPY"):
        flags, args = copy.flags_and_args()
        if "from" not in flags:
            sources += args[:-1]
    return sources


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    context = tmp_path_factory.mktemp("context")
    for source in _copied_sources():
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(
                origin, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(origin, context / source)
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: setuptools is installed here and the index may be out of reach.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*command, "-q", "--wheel-dir", str(out), str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("refit_plane-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def _entry_points(wheel: zipfile.ZipFile) -> configparser.ConfigParser:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(name).decode())
    return parser


def test_wheel_declares_the_commands_and_the_vllm_plugin(wheel: zipfile.ZipFile) -> None:
    entry_points = _entry_points(wheel)
    scripts = dict(entry_points["console_scripts"])
    assert scripts["refit-coordinator"] == "refitplane.coordinator.__main__:main"
    assert scripts["refitctl"] == "refitplane.cli.refitctl:main"
    assert dict(entry_points["vllm.general_plugins"]) == dict(
        pyproject()["project"]["entry-points"]["vllm.general_plugins"]
    )


def test_wheel_contains_the_services_and_their_data(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    services = [d for d in (REPO / "services").iterdir() if (d / "__init__.py").is_file()]
    assert services
    expected = [
        f"refitplane/{path.relative_to(REPO / 'services').as_posix()}"
        for service in services
        for path in service.rglob("*")
        if path.suffix in {".py", ".lua"} and "__pycache__" not in path.parts
    ]
    missing = sorted(set(expected) - names)
    assert not missing, f"the wheel lacks {len(missing)} of {len(expected)} files: {missing[:5]}"
