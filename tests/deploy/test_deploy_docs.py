"""docs/deploy.md stays true to the chart: its values table covers every key of values.yaml
(and names no key that does not exist), and the files it points to exist."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.chart_support import CHART_DIR, REPO

pytestmark = pytest.mark.unit

DOC = REPO / "docs" / "deploy.md"
# Maps passed through to Kubernetes or holding free-form labels: documented as one key.
OPAQUE = {
    "resources",
    "podSecurityContext",
    "securityContext",
    "nodeSelector",
    "affinity",
    "podAnnotations",
    "podLabels",
    "annotations",
    "labels",
    "clientPodLabels",
    "clientNamespaceLabels",
}


def _leaves(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value and key not in OPAQUE:
            yield from _leaves(value, path)
        else:
            yield path


def _documented_keys() -> set[str]:
    """First column of the values table (section 3, up to its first subsection)."""
    text = DOC.read_text()
    section = text.split("## 3. Configure", 1)[1].split("\n### ", 1)[0]
    keys = set()
    for line in section.splitlines():
        match = re.match(r"^\| `([A-Za-z0-9_.]+)` \|", line)
        if match:
            keys.add(match.group(1))
    return keys


def _exists(values: dict[str, Any], path: str) -> bool:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_value_is_documented() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    documented = _documented_keys()
    missing = [
        leaf
        for leaf in _leaves(values)
        if not any(leaf == key or leaf.startswith(key + ".") for key in documented)
    ]
    assert not missing, f"docs/deploy.md does not document {missing}"


def test_every_documented_value_exists() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    unknown = [k for k in _documented_keys() if not _exists(values, k)]
    assert not unknown, f"docs/deploy.md documents keys values.yaml lacks: {unknown}"


def test_referenced_files_exist() -> None:
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:deploy|services|docs)/[A-Za-z0-9_./-]+)`", text))
    assert paths
    for path in paths:
        assert (REPO / path).exists(), f"docs/deploy.md points to missing {path}"
