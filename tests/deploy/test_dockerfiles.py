"""The container images, checked without Docker: what they COPY is in the build context,
their commands are console scripts the distribution declares, bases are pinned, they run
as a non-root user, plus the hadolint rules that matter for these files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart_support import CHART_DIR, EXAMPLES_DIR, REPO, load_yaml_documents
from tests.deploy.dockerfile_support import (
    DISTRIBUTIONS,
    DOCKER_DIR,
    Dockerfile,
    DockerIgnore,
    Instruction,
    declared_scripts,
    dockerfiles,
    module_source,
    parse_dockerfile,
    pyproject,
    vllm_plugins,
)

pytestmark = pytest.mark.unit

IMAGES = {"coordinator.Dockerfile", "generator.Dockerfile", "trainer.Dockerfile"}
# Scripts an image or pod runs that refit-plane must provide, with their intended targets
# (the contract in the deploy brief). The sidecar module is written by the agents issue.
REQUIRED_SCRIPTS = {
    "refit-coordinator": "refitplane.coordinator.__main__:main",
    "refitctl": "refitplane.cli.refitctl:main",
    "refit-sidecar": "refitplane.generator.sidecar_main:main",
}
# Programs the base images provide.
BASE_IMAGE_PROGRAMS = {"vllm", "python", "python3", "torchrun"}
CONTEXT_IGNORE = DockerIgnore.load(REPO / ".dockerignore")


@pytest.fixture(scope="module", params=sorted(IMAGES))
def dockerfile(request: pytest.FixtureRequest) -> Dockerfile:
    return parse_dockerfile(DOCKER_DIR / str(request.param))


def test_the_three_images_exist() -> None:
    assert {d.name for d in dockerfiles()} == IMAGES


def test_base_images_are_pinned(dockerfile: Dockerfile) -> None:
    stage_names = {name for _, name in dockerfile.stages() if name}
    for image, _ in dockerfile.stages():
        if image in stage_names:
            continue
        assert "$" not in image, f"{dockerfile.name}: FROM {image} has an unresolved ARG"
        name, _, digest = image.partition("@")
        last = name.rsplit("/", 1)[-1]
        tag = last.split(":", 1)[1] if ":" in last else ""
        assert tag or digest, f"{dockerfile.name}: FROM {image} is not pinned"
        assert tag != "latest", f"{dockerfile.name}: FROM {image}"
        # A version, not a moving name like "slim" or "stable".
        assert re.search(r"\d+\.\d+", tag) or digest, f"{dockerfile.name}: FROM {image}"
        assert "." in name.split("/", 1)[0], f"{dockerfile.name}: name the registry of {image}"


def test_runs_as_numeric_non_root_user(dockerfile: Dockerfile) -> None:
    users = [i for i in dockerfile.final_stage() if i.keyword == "USER"]
    assert users, f"{dockerfile.name}: the final stage sets no USER (runs as root)"
    user, _, group = users[-1].value.partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
    assert user.isdigit(), f"{dockerfile.name}: USER {users[-1].value} is not numeric"
    assert int(user) != 0, f"{dockerfile.name}: USER {users[-1].value} is root"
    assert not group or (group.isdigit() and int(group) != 0)
    assert user == "10001", "the chart and examples run as uid 10001"


def test_copied_files_are_in_the_build_context(dockerfile: Dockerfile) -> None:
    assert not dockerfile.of("ADD"), f"{dockerfile.name}: use COPY (hadolint DL3020)"
    stage_names = {name for _, name in dockerfile.stages() if name}
    copies = dockerfile.of("COPY")
    assert copies
    for copy in copies:
        flags, args = copy.flags_and_args()
        if "from" in flags:
            assert flags["from"] in stage_names, f"{dockerfile.name}:{copy.line} --from"
            continue
        *sources, _destination = args
        for source in sources:
            path = REPO / source
            assert path.exists(), f"{dockerfile.name}:{copy.line}: {source} is not in the context"
            assert not CONTEXT_IGNORE.excluded(source), (
                f"{dockerfile.name}:{copy.line}: {source} is excluded by .dockerignore"
            )


def test_dockerignore_keeps_the_context_small() -> None:
    for heavy in (".git", "build", "tests", "docs", "refit_plane.egg-info", "deploy/helm"):
        assert CONTEXT_IGNORE.excluded(heavy), heavy
    for nested in ("refitplane/reshard/__pycache__/plan.cpython-311.pyc", "services/x.pyc"):
        assert CONTEXT_IGNORE.excluded(nested), nested
    needed_files = (
        "pyproject.toml",
        "README.md",
        "refitplane/errors.py",
        "services/coordinator/pyproject.toml",
        "services/x/refitplane/x/y.py",
    )
    for needed in needed_files:
        assert not CONTEXT_IGNORE.excluded(needed), needed


def test_dockerignore_matcher_semantics(tmp_path: Path) -> None:
    ignore_file = tmp_path / ".dockerignore"
    ignore_file.write_text("# c\n*.md\n!README.md\ndocs/**\n**/cache\n/build/\n")
    ignore = DockerIgnore.load(ignore_file)
    assert ignore.excluded("NOTES.md")
    assert not ignore.excluded("README.md")
    assert not ignore.excluded("sub/NOTES.md"), "* does not cross directories"
    assert ignore.excluded("docs/a/b.txt")
    assert ignore.excluded("a/b/cache/x")
    assert ignore.excluded("build/lib/x.py")
    assert not ignore.excluded("src/build.py")


def _entry_commands(dockerfile: Dockerfile) -> list[tuple[Instruction, list[str]]]:
    out = []
    for instruction in dockerfile.final_stage():
        if instruction.keyword in {"ENTRYPOINT", "CMD"}:
            form = instruction.exec_form()
            assert form, f"{dockerfile.name}:{instruction.line}: use the exec (JSON) form"
            out.append((instruction, form))
    return out


def image_distributions(dockerfile: Dockerfile) -> tuple[str, ...]:
    """The distributions an image installs: the core and the services it copies."""
    copied = [a for c in dockerfile.of("COPY") for a in c.flags_and_args()[1][:-1]]
    services = tuple(d for d in DISTRIBUTIONS if d != "." and d in copied)
    return (".", *services)


def test_each_image_copies_and_installs_only_its_service(dockerfile: Dockerfile) -> None:
    role = dockerfile.name.removesuffix(".Dockerfile")
    assert image_distributions(dockerfile) == (".", f"services/{role}")
    install = next(i for i in dockerfile.of("RUN") if "pip install" in i.value)
    assert f"./services/{role}" in install.value, f"{dockerfile.name}: installs no service"
    others = [r for r in ("coordinator", "trainer", "generator") if r != role]
    assert not any(f"services/{r}" in install.value for r in others), dockerfile.name


def test_coordinator_distribution_needs_no_torch_or_vllm() -> None:
    def requirements(distribution: str) -> list[str]:
        return [r.lower() for r in pyproject(distribution)["project"]["dependencies"]]

    core = requirements(".")
    for requirement in [*core, *requirements("services/coordinator")]:
        assert not requirement.startswith(("torch", "vllm", "nccl4py")), requirement
        assert "[" not in requirement, f"the coordinator pulls an extra: {requirement}"


def test_distributions_release_together() -> None:
    version_file = (REPO / "refitplane" / "version.py").read_text()
    (core_version,) = re.findall(r'__version__ = "([^"]+)"', version_file)
    for distribution in DISTRIBUTIONS[1:]:
        project = pyproject(distribution)["project"]
        assert project["version"] == core_version, distribution
        pinned = [r for r in project["dependencies"] if r.startswith("refit-plane")]
        assert pinned, f"{distribution} does not depend on the core"
        assert all(r.endswith(f"=={core_version}") for r in pinned), pinned


def test_entry_points_are_declared_console_scripts(dockerfile: Dockerfile) -> None:
    scripts = declared_scripts(image_distributions(dockerfile))
    for instruction, form in _entry_commands(dockerfile):
        program = form[0]
        if program in BASE_IMAGE_PROGRAMS:
            continue
        assert program in scripts, (
            f"{dockerfile.name}:{instruction.line}: {program} is not in [project.scripts]"
        )


def test_coordinator_image_contract() -> None:
    coordinator = parse_dockerfile(DOCKER_DIR / "coordinator.Dockerfile")
    ((_, entrypoint),) = _entry_commands(coordinator)
    assert entrypoint == ["refit-coordinator"]
    exposed = {int(p) for i in coordinator.of("EXPOSE") for p in i.value.split()}
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert exposed == {values["ports"]["grpc"], values["ports"]["lane"], values["ports"]["http"]}
    assert [i.value for i in coordinator.final_stage() if i.keyword == "STOPSIGNAL"] == ["SIGTERM"]
    # Slim and torch-free: the runtime base is python:*-slim and nothing installs extras.
    final_base = coordinator.stages()[-1][0]
    assert re.search(r"/python:3\.11\.\d+-slim", final_base), final_base
    runs = " ".join(i.value for i in coordinator.of("RUN"))
    assert "[" not in runs
    assert "torch" not in runs
    assert values["image"]["repository"].endswith("/refit-coordinator")


def test_agent_images_keep_their_base_torch() -> None:
    """Installing refit-plane must not replace the CUDA builds of torch/vLLM in the base."""
    for name, must_pin in (("generator.Dockerfile", "vllm"), ("trainer.Dockerfile", "torch")):
        image = parse_dockerfile(DOCKER_DIR / name)
        install = next(i for i in image.of("RUN") if "pip install" in i.value)
        assert "--constraint" in install.value, name
        assert must_pin in install.value.split("pip freeze", 1)[1].split(">", 1)[0], name
        default_extras = next(
            i.value.partition("=")[2] for i in image.of("ARG") if i.value.startswith("REFIT_")
        )
        service = image_distributions(image)[-1]
        declared = pyproject(service)["project"]["optional-dependencies"]
        for extra in default_extras.split(","):
            assert extra in declared, f"{name}: extra {extra!r} is not in pyproject"


def test_generator_image_ships_the_vllm_plugin() -> None:
    assert "refitplane" in vllm_plugins()
    generator = parse_dockerfile(DOCKER_DIR / "generator.Dockerfile")
    assert "vllm/vllm-openai:v0." in generator.stages()[0][0]
    install = next(i for i in generator.of("RUN") if "pip install" in i.value)
    assert "vllm.general_plugins" in install.value
    assert "'refitplane'" in install.value


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_hadolint_rules(name: str) -> None:
    image = parse_dockerfile(DOCKER_DIR / name)
    pipefail = False
    for instruction in image.instructions:
        where = f"{name}:{instruction.line}"
        if instruction.keyword == "SHELL":
            pipefail = "pipefail" in instruction.value
        if instruction.keyword == "WORKDIR":
            assert instruction.value.startswith("/"), f"{where}: relative WORKDIR (DL3000)"
        if instruction.keyword != "RUN":
            continue
        run = instruction.value
        if "|" in run.replace("||", ""):
            assert pipefail, f"{where}: pipe without SHELL pipefail (DL4006)"
        if re.search(r"\bpip3? install\b", run):
            assert "--no-cache-dir" in run, f"{where}: pip install without --no-cache-dir (DL3042)"
        assert "apt-get upgrade" not in run, f"{where}: DL3005"
        assert "sudo " not in run, f"{where}: DL3004"
        assert not re.search(r"(^|&&)\s*cd\s", run), f"{where}: cd in RUN, use WORKDIR (DL3003)"
        if "apt-get install" in run:
            assert "--no-install-recommends" in run, f"{where}: DL3015"
            assert "rm -rf /var/lib/apt/lists" in run, f"{where}: DL3009"


@pytest.mark.parametrize("script", sorted(REQUIRED_SCRIPTS))
def test_required_console_scripts_resolve(script: str) -> None:
    target = REQUIRED_SCRIPTS[script]
    scripts = declared_scripts()
    if script not in scripts:
        pytest.skip(
            f"{script} is not declared yet: pyproject [project.scripts] needs "
            f'{script} = "{target}" (deploy/examples run it)'
        )
    assert scripts[script] == target
    module, _, function = target.partition(":")
    source = module_source(module)
    if source is None:
        pytest.skip(f"{module} is not written yet")
    tree = ast.parse(source.read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {
        alias.asname or alias.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom)
        for alias in n.names
    }
    assert function in functions | imported, f"{source} defines no {function}"


def test_examples_run_what_the_images_provide() -> None:
    scripts = set(declared_scripts()) | set(REQUIRED_SCRIPTS)
    for path in sorted(EXAMPLES_DIR.glob("*.yaml")):
        for manifest in load_yaml_documents(path):
            template = manifest.get("spec", {}).get("template", {}).get("spec")
            if not template:
                continue
            for c in template["containers"]:
                command = c.get("command", [])
                if command:
                    assert command[0] in scripts | BASE_IMAGE_PROGRAMS, f"{path.name}: {command}"
