"""Make `refitplane.generator` / `.coordinator` / `.trainer` importable from a source checkout.

pyproject.toml maps `services/*` onto `refitplane.*` with `package-dir`, but
`[tool.setuptools.packages.find]` only discovers packages under `refitplane/`, so the strict
editable install links none of the service packages. Until the package list names them,
this adds the checkout's `services/` directory to the `refitplane` package path. It does
nothing when the service packages already import (a fixed or a regular install).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import refitplane


def ensure_service_packages() -> None:
    if importlib.util.find_spec("refitplane.generator") is not None:
        return
    services = Path(refitplane.__file__).resolve().parent.parent / "services"
    if (services / "generator" / "__init__.py").is_file() and str(
        services
    ) not in refitplane.__path__:
        refitplane.__path__.append(str(services))
