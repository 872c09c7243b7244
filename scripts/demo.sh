#!/usr/bin/env bash
# The main job (README): set up, then a complete refit demo on this machine (CPU is fine).
# Extra arguments go to `refitctl demo` (e.g. `bash scripts/demo.sh --model dense`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${REFIT_VENV:-.venv}/bin/activate"
exec refitctl demo "$@"
