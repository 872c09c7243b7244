#!/usr/bin/env bash
# Static checks: generated stubs fresh, ruff lint + format, mypy (strict) on every portion
# of the refitplane namespace (the core here, the services under services/<role>/), read
# straight from the checkout (pyproject's mypy_path names the four roots); then buf lint,
# buf breaking and hadolint (scripts/check_contracts.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" scripts/gen_protos.py --check
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy refitplane services/coordinator/refitplane services/trainer/refitplane \
  services/generator/refitplane
bash scripts/check_contracts.sh
