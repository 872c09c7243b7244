"""The Grafana dashboard the chart ships, and the metric names its queries use."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "helm"
    / "refit-coordinator"
    / "dashboards"
    / "refit-coordinator.json"
)

# A metric name in PromQL: refit_... not followed by "(" (a function) nor preceded by a
# letter (a label such as refit_job inside braces is preceded by "{" or ",").
_METRIC = re.compile(r"(?<![\w{,])refit_[a-z_]+(?![\w(])")


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def queries(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, expression) of every query, the template variables' included."""
    for panel in doc["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]
    for variable in doc["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            yield f"variable {variable['name']}", query["query"]


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (`refit_x_bucket`, `refit_y_total`, ...)."""
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    # Grafana's label_values(metric, label): the second argument is a label.
    without_labels = re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", without_labels)
    return set(_METRIC.findall(without_labels))
