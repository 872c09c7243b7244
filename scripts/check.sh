#!/usr/bin/env bash
# Static checks: generated stubs fresh, ruff lint + format, mypy (strict) on the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" scripts/gen_protos.py --check
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# The package maps services/* onto refitplane.*; the strict editable install's link tree
# is the one place where that package exists as files, so mypy runs from there.
tree=$(ls -d build/__editable__.refit_plane-*/ 2>/dev/null | head -n1)
if [ -z "$tree" ]; then
  echo "no editable link tree: run scripts/setup.sh first" >&2
  exit 1
fi
(cd "$tree" && "$PY" -m mypy --config-file ../../pyproject.toml -p refitplane)
