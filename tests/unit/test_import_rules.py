"""The house's layers, checked on the source: every package imports only from below it.

    roles      refitplane.coordinator, .trainer, .generator (services/<role>/refitplane/<role>);
               refitctl (.cli)
    runtimes   refitplane.agent (agent session, data-plane member), refitplane.client;
               refitplane.replica (the replica controller both roles run, on both)
    vocabulary refitplane.protocol (enums, messages, models, the proto converters, channels)
    core       refitplane.reshard (layouts, plans, executor), refitplane.models, errors and the
               one list of failure reasons they carry (reasons), stubs, lifecycle (signals,
               start-up failures and exit statuses of every command), logs (text or JSON log
               lines of every command)

On top, the demo and the harness benchmarks run (`refitplane.demo`, `refitplane.testing`) may
compose anything; nothing below them imports them (the CLI starts the demo). Every import
counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("coordinator", "trainer", "generator")
CORE = frozenset(
    {
        "reasons",
        "errors",
        "version",
        "lifecycle",
        "logs",
        "http_json",
        "_generated",
        "reshard",
        "models",
    }
)
VOCABULARY = frozenset({"reasons", "errors", "_generated", "reshard", "protocol"})

# Layer → the layers it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "reasons": frozenset(),
    "errors": frozenset({"reasons"}),
    "version": frozenset(),
    "lifecycle": frozenset(),
    "logs": frozenset(),
    "http_json": frozenset(),
    "reshard": frozenset({"reasons", "errors"}),
    "models": frozenset({"reasons", "errors", "reshard"}),
    "protocol": frozenset({"reasons", "errors", "_generated", "reshard"}),
    "agent": VOCABULARY,
    "client": VOCABULARY - {"reshard"},
    # The replica controller: an agent that watches refits through the client API.
    "replica": VOCABULARY | {"agent", "client"},
    # http_json: the probe port answers with the handler every small stdlib server shares.
    "coordinator": VOCABULARY | {"version", "lifecycle", "logs", "http_json"},
    # Trainer ranks trigger refits themselves (`TrainerAgent.refit`) and the sidecar watches
    # topology and refits: both through the public client API.
    "trainer": CORE | VOCABULARY | {"agent", "client", "replica"},
    "generator": CORE | VOCABULARY | {"agent", "client", "replica"},
    "cli": CORE | VOCABULARY | {"client", "demo"},
}
ON_TOP = frozenset({"demo", "testing"})

# Where a role may use another role's code, and why. None: what both need (the replica
# controller, vLLM backend registration) lives in `refitplane.replica`.
CROSS_ROLE_EXCEPTIONS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str  # its file, relative to the repository
    line: int
    target: str  # the imported refitplane module (or package)


# The namespace's roots: a module's name is its path below one of them.
NAMESPACE_ROOTS = (ROOT, *(ROOT / "services" / role for role in ROLES))


def _sources() -> Iterator[tuple[str, Path]]:
    """(module name, file) of every module of the namespace, read from the checkout."""
    for root in NAMESPACE_ROOTS:
        for path in sorted((root / "refitplane").rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if rel.parts[:2] == ("refitplane", "_generated"):
                continue
            yield ".".join(p for p in rel.parts if p != "__init__"), path


def test_the_folder_is_the_import_path() -> None:
    """No portion claims the namespace, and each role's package sits in its own root."""
    for root in NAMESPACE_ROOTS:
        assert not (root / "refitplane" / "__init__.py").exists(), root
    for role in ROLES:
        assert (ROOT / "services" / role / "refitplane" / role / "__init__.py").is_file(), role
        strays = [p for p in (ROOT / "services" / role / "refitplane").iterdir() if p.name != role]
        assert not strays, f"services/{role} contributes more than refitplane.{role}: {strays}"


def _imports() -> list[Import]:
    found = []
    for module, path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from refitplane import errors` imports refitplane.errors.
                if node.module == "refitplane":
                    targets = [f"refitplane.{a.name}" for a in node.names]
                else:
                    targets = [node.module]
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import")
            rel = str(path.relative_to(ROOT))
            found += [
                Import(module, rel, node.lineno, t)
                for t in targets
                if t == "refitplane" or t.startswith("refitplane.")
            ]
    return found


def layer(module: str) -> str:
    """refitplane.<layer>...; "" for the bare namespace (which holds nothing to import)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return _imports()


def test_the_scan_sees_the_roles_and_their_vocabulary(imports):
    """Guards the rules below against passing on an empty scan (a moved tree)."""
    seen = {(i.module, i.target) for i in imports}
    assert ("refitplane.coordinator.core.driver", "refitplane.protocol") in seen
    assert ("refitplane.agent.session", "refitplane.protocol") in seen
    assert ("refitplane.client.sync", "refitplane.protocol.convert") in seen
    # Leaves import nothing of refitplane.
    leaves = {"reasons", "errors", "version", "lifecycle", "logs", "http_json"}
    assert {layer(i.module) for i in imports} >= set(ALLOWED) - leaves | ON_TOP


def test_every_layer_imports_only_what_sits_below_it(imports):
    bad = []
    for i in imports:
        src, dst = layer(i.module), layer(i.target)
        if src == dst or src in ON_TOP:
            continue
        if src in ROLES and dst in ROLES:
            continue  # the next test's rule
        if src not in ALLOWED:
            bad.append(f"{i.path}: layer {src!r} has no rule (add it to ALLOWED)")
        elif dst not in ALLOWED[src]:
            bad.append(
                f"{i.path}:{i.line}: {i.module} imports {i.target}; "
                f"{src or 'refitplane'} may import only {sorted(ALLOWED[src])}"
            )
    assert not bad, "\n".join(bad)


def test_no_role_imports_another_role(imports):
    bad = [
        f"{i.path}:{i.line}: {i.module} imports {i.target}"
        for i in imports
        if layer(i.module) in ROLES
        and layer(i.target) in ROLES
        and layer(i.module) != layer(i.target)
        and (i.module, i.target) not in CROSS_ROLE_EXCEPTIONS
    ]
    assert not bad, "\n".join(bad)


def test_the_cross_role_exceptions_are_still_needed(imports):
    """An exception nobody needs any more goes, so the list says only what is true."""
    seen = {(i.module, i.target) for i in imports}
    assert not CROSS_ROLE_EXCEPTIONS - seen, CROSS_ROLE_EXCEPTIONS - seen


def test_the_vocabulary_names_no_runtime_and_no_role(imports):
    """Spelled out for the rules a newcomer asks about first (the table above implies them)."""
    for i in imports:
        src, dst = layer(i.module), layer(i.target)
        assert not (src == "coordinator" and dst in {"agent", "client"}), i
        assert not (src == "client" and dst == "agent"), i
        assert not (src == "agent" and dst == "client"), i
        assert not (src == "protocol" and dst not in ALLOWED["protocol"] | {"protocol"}), i


def test_no_layer_imports_another_layers_private_names():
    """A leading underscore means "this package's own": the demo and the harness (which may
    import each other) included, they share public names only."""
    bad = []
    for module, path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module):
                continue
            if not node.module.startswith("refitplane.") or layer(node.module) == layer(module):
                continue
            private = [
                a.name
                for a in node.names
                if a.name.startswith("_")
                and not (a.name.startswith("__") and a.name.endswith("__"))
            ]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {private} of {node.module}")
    assert not bad, "\n".join(bad)
