"""refitplane: a weight-refit control plane for RL post-training.

`refitplane.reshard` is the shared core (layouts, planner, transports, executor) that the
coordinator (`refitplane.coordinator`), the trainer agent (`refitplane.trainer`) and the
generator agent (`refitplane.generator`) all import.
"""

from pathlib import Path

__version__ = "0.1.0"

# The services live under services/<name>/ (the design card's layout) and are installed as
# refitplane.<name> (pyproject's package-dir). When this package is imported straight from
# a source checkout (tests, scripts run from the repo root), let the same names resolve to
# services/ too; in an installed wheel there is no such folder and this does nothing.
_services = Path(__file__).resolve().parent.parent / "services"
if _services.is_dir() and (_services / "coordinator").is_dir():
    __path__.append(str(_services))
