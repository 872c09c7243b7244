"""Just enough of Docker's file formats to check our images without Docker: Dockerfile
instructions (continuations, comments, ARG defaults) and .dockerignore matching
(moby/patternmatcher semantics: last matching pattern wins, `!` re-includes, a pattern
that matches a parent directory matches everything below it)."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.deploy.chart_support import REPO

DOCKER_DIR = REPO / "deploy" / "docker"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the rest, continuations joined
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON-array form of CMD/ENTRYPOINT/SHELL, or None for shell form."""
        try:
            parsed = json.loads(self.value)
        except ValueError:
            return None
        if isinstance(parsed, list) and all(isinstance(p, str) for p in parsed):
            return parsed
        return None

    def flags_and_args(self) -> tuple[dict[str, str], list[str]]:
        """`COPY --from=build --chown=1:1 a b c` -> ({'from': 'build', ...}, ['a', 'b', 'c'])."""
        flags: dict[str, str] = {}
        args: list[str] = []
        for token in self.value.split():
            if token.startswith("--") and not args:
                key, _, val = token[2:].partition("=")
                flags[key] = val
            else:
                args.append(token)
        return flags, args


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    instructions: list[Instruction]

    @property
    def name(self) -> str:
        return self.path.name

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def global_args(self) -> dict[str, str]:
        """ARG defaults declared before the first FROM (the ones FROM lines can use)."""
        defaults: dict[str, str] = {}
        for instruction in self.instructions:
            if instruction.keyword == "FROM":
                break
            if instruction.keyword == "ARG":
                name, _, default = instruction.value.partition("=")
                defaults[name.strip()] = default.strip().strip('"')
        return defaults

    def stages(self) -> list[tuple[str, str | None]]:
        """(resolved base image, stage name) for every FROM."""
        args = self.global_args()
        stages: list[tuple[str, str | None]] = []
        for instruction in self.of("FROM"):
            tokens = [t for t in instruction.value.split() if not t.startswith("--platform")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), tokens[0])
            name = tokens[2] if len(tokens) >= 3 and tokens[1].upper() == "AS" else None
            stages.append((image, name))
        return stages

    def final_stage(self) -> list[Instruction]:
        last_from = max(i for i, ins in enumerate(self.instructions) if ins.keyword == "FROM")
        return self.instructions[last_from:]


def parse_dockerfile(path: Path) -> Dockerfile:
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(part for part in pending if part)
        pending = []
        keyword, _, value = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
    if pending:
        raise ValueError(f"{path}: the last instruction ends with a line continuation")
    return Dockerfile(path, instructions)


def dockerfiles() -> list[Dockerfile]:
    return [parse_dockerfile(p) for p in sorted(DOCKER_DIR.glob("*.Dockerfile"))]


# --- .dockerignore ------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


@dataclass(frozen=True)
class DockerIgnore:
    rules: list[tuple[re.Pattern[str], bool]]  # (pattern, is_exception)

    @classmethod
    def load(cls, path: Path) -> DockerIgnore:
        rules: list[tuple[re.Pattern[str], bool]] = []
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exception = line.startswith("!")
            pattern = line[1:].strip() if exception else line
            pattern = pattern.strip("/") or "."
            rules.append((_pattern_regex(pattern), exception))
        return cls(rules)

    def excluded(self, relative: str) -> bool:
        parts = Path(relative).parts
        candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        excluded = False
        for regex, exception in self.rules:
            if any(regex.match(candidate) for candidate in candidates):
                excluded = not exception
        return excluded


# --- pyproject ----------------------------------------------------------------------------


# The four distributions of the `refitplane` namespace: the core at the root, one per role.
DISTRIBUTIONS = (".", "services/coordinator", "services/trainer", "services/generator")


def pyproject(distribution: str = ".") -> dict[str, Any]:
    """One distribution's pyproject.toml (the core's by default)."""
    return tomllib.loads((REPO / distribution / "pyproject.toml").read_text())


def declared_scripts(distributions: tuple[str, ...] = DISTRIBUTIONS) -> dict[str, str]:
    """Console scripts (name → target) the given distributions declare, together."""
    scripts: dict[str, str] = {}
    for distribution in distributions:
        scripts |= pyproject(distribution)["project"].get("scripts", {})
    return scripts


def vllm_plugins() -> dict[str, str]:
    """The vLLM plugin entry points (the generator's distribution declares them)."""
    entry_points = pyproject("services/generator")["project"]["entry-points"]
    return dict(entry_points["vllm.general_plugins"])


def module_source(module: str) -> Path | None:
    """Where an importable module of the distribution lives (None: not importable yet)."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin)
