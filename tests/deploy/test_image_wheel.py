"""What each image's `pip install` puts into it: wheels built from exactly the files that
image's Dockerfile COPYs (the core and its one service), checked for every module and data
file of the service, the console scripts, the vLLM plugin entry point, and the namespace
(no distribution ships refitplane/__init__.py, so the portions merge)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.chart_support import REPO
from tests.deploy.dockerfile_support import DOCKER_DIR, parse_dockerfile, vllm_plugins

pytestmark = pytest.mark.integration

ROLES = ("coordinator", "trainer", "generator")


def _copied_sources(role: str) -> list[str]:
    """Build-context paths the role's image copies into its build stage."""
    image = parse_dockerfile(DOCKER_DIR / f"{role}.Dockerfile")
    sources: list[str] = []
    for copy in image.of("COPY"):
        flags, args = copy.flags_and_args()
        if "from" not in flags:
            sources += args[:-1]
    return sources


@pytest.fixture(scope="module", params=ROLES)
def wheels(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, zipfile.ZipFile]]]:
    """(role, {distribution name: wheel}) for the core and the role's service."""
    role = str(request.param)
    context = tmp_path_factory.mktemp(f"context-{role}")
    for source in _copied_sources(role):
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(
                origin, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(origin, context / source)
    out = tmp_path_factory.mktemp(f"wheels-{role}")
    # No build isolation: setuptools is installed here and the index may be out of reach.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    for project in (context, context / "services" / role):
        subprocess.run(
            [*command, "--wheel-dir", str(out), str(project)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    archives = {path.name.split("-")[0]: zipfile.ZipFile(path) for path in out.glob("*.whl")}
    assert set(archives) == {"refit_plane", f"refit_plane_{role}"}, sorted(archives)
    yield role, archives
    for archive in archives.values():
        archive.close()


def _entry_points(wheel: zipfile.ZipFile) -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    found = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    for name in found:
        parser.read_string(wheel.read(name).decode())
    return parser


def test_service_wheel_holds_every_module_and_data_file(
    wheels: tuple[str, dict[str, zipfile.ZipFile]],
) -> None:
    role, archives = wheels
    service = archives[f"refit_plane_{role}"]
    root = REPO / "services" / role
    expected = {
        path.relative_to(root).as_posix()
        for path in (root / "refitplane" / role).rglob("*")
        if path.suffix in {".py", ".lua", ".typed"} and "__pycache__" not in path.parts
    }
    names = set(service.namelist())
    missing = sorted(expected - names)
    assert not missing, f"the {role} wheel lacks {len(missing)} files: {missing[:5]}"
    strays = sorted(
        n for n in names if not n.startswith(f"refitplane/{role}/") and ".dist-info/" not in n
    )
    assert not strays, f"the {role} wheel ships files of other packages: {strays[:5]}"


def test_core_wheel_holds_the_core_and_no_service(
    wheels: tuple[str, dict[str, zipfile.ZipFile]],
) -> None:
    _, archives = wheels
    names = set(archives["refit_plane"].namelist())
    core = REPO / "refitplane"
    expected = {
        path.relative_to(REPO).as_posix()
        for path in core.rglob("*")
        if path.suffix in {".py", ".pyi"} and "__pycache__" not in path.parts
    }
    assert expected <= names, sorted(expected - names)[:5]
    assert not any(n.startswith(f"refitplane/{r}/") for n in names for r in ROLES)


def test_no_wheel_claims_the_namespace(wheels: tuple[str, dict[str, zipfile.ZipFile]]) -> None:
    """A refitplane/__init__.py in any wheel would hide every other portion (PEP 420)."""
    _, archives = wheels
    for name, archive in archives.items():
        assert "refitplane/__init__.py" not in archive.namelist(), name


def test_wheels_declare_the_commands_and_the_vllm_plugin(
    wheels: tuple[str, dict[str, zipfile.ZipFile]],
) -> None:
    role, archives = wheels
    core_scripts = dict(_entry_points(archives["refit_plane"])["console_scripts"])
    assert core_scripts == {"refitctl": "refitplane.cli.refitctl:main"}
    service = _entry_points(archives[f"refit_plane_{role}"])
    scripts = dict(service["console_scripts"]) if service.has_section("console_scripts") else {}
    if role == "coordinator":
        assert scripts == {"refit-coordinator": "refitplane.coordinator.__main__:main"}
    if role == "generator":
        assert scripts == {"refit-sidecar": "refitplane.generator.sidecar_main:main"}
        assert dict(service["vllm.general_plugins"]) == vllm_plugins()
    if role == "trainer":
        assert not scripts


def test_editable_checkout_resolves_every_portion_to_its_folder() -> None:
    """The folder is the import path: each role imports from services/<role>/refitplane/<role>."""
    for role in ROLES:
        module = __import__(f"refitplane.{role}", fromlist=["_"])
        expected = REPO / "services" / role / "refitplane" / role / "__init__.py"
        assert Path(str(module.__file__)).resolve() == expected.resolve(), role
