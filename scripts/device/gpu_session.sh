#!/usr/bin/env bash
# One GPU session, step by step, on a device machine (layout tp1: 2 GPUs; tp2, 2xtp1: 4).
# Prepare here first:
#     TRIM=1 bash ../shared/device/stage_vllm.sh      # vLLM 0.26 in .stage/p1..p3
#     bash scripts/device/stage_wheels.sh             # nccl4py, grpc, ... into .whl/
#     for d in . services/coordinator services/trainer services/generator; do
#       python3 -m pip wheel -q --no-deps "$d" -w .whl; done   # the four distributions
#       (the core and the three services; the generator's carries the vLLM plugin entry point)
# then send, back to back (a machine goes back after 30 s idle):
#     carry .whl:               bash scripts/device/gpu_session.sh wheels   (+ data-plane tests)
#     carry .stage/p1:          bash scripts/device/gpu_session.sh stage
#     carry .stage/p2:          bash scripts/device/gpu_session.sh stage
#     carry .stage/p3:          bash scripts/device/gpu_session.sh tests [pytest args]
#     (nothing carried):        bash scripts/device/gpu_session.sh bench qwen3-8b tp2 [gpu_refit args]
#     (nothing carried):        bash scripts/device/gpu_session.sh model qwen3-8b tp2 [model_refit args]
# The whole tests/gpu suite in calls that fit a session's device time: gpu_suite.sh.
# Logs and JSON results go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/device/session_setup.sh
. scripts/device/session_setup.sh

step=${1:-}
shift || true
case "$step" in
  stage) stage ;;
  wheels)
    # Keep the project's wheels on this machine (later steps need not carry .whl), then
    # run the data-plane GPU tests (checksums, nccl4py transport) from this checkout.
    rm -rf /tmp/whl && cp -a .whl /tmp/whl && nccl_only || exit 1
    nvidia-smi --query-gpu=index,name,memory.total --format=csv
    python3 -m pytest tests/gpu/test_checksum_cuda.py tests/gpu/test_nccl_transport.py \
      -v -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest-dataplane.log"
    exit "${PIPESTATUS[0]}"
    ;;
  tests)
    setup || exit 1
    nvidia-smi --query-gpu=index,name,memory.total --format=csv
    python3 -m pytest tests/gpu -v -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest-gpu.log"
    exit "${PIPESTATUS[0]}"
    ;;
  bench | model)
    setup || exit 1
    script=$([ "$step" = bench ] && echo gpu_refit || echo model_refit)
    model=$1 layout=$2
    shift 2
    python3 "benchmarks/$script.py" --model "$model" --layout "$layout" \
      --out "$OUT/$script-$model-$layout.json" "$@" 2>&1 | tee "$OUT/$script-$model-$layout.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *) echo "usage: $0 wheels | stage | tests [pytest args] | bench|model MODEL LAYOUT [benchmark args]" >&2; exit 2 ;;
esac
