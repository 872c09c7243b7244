"""The chart rendered with its default values, shared by the chart's test modules."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import Rendered, render


@pytest.fixture(scope="module")
def default() -> Rendered:
    """`helm install --dry-run` of the chart with its default values."""
    return render()
