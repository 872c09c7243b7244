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
# Logs and JSON results go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0

stage() {
  mkdir -p /tmp/vstage && cp -a .stage/p* /tmp/vstage/ && du -sb /tmp/vstage/p*
}

setup() {
  # shellcheck disable=SC1090
  . "$(ls -d .stage/p3 /tmp/vstage/p3 2>/dev/null | head -n1)/install_vllm_on_device.sh" || return 1
  if [ ! -f /tmp/site/.refit_installed ]; then
    # .whl carried now, or kept in /tmp/whl by an earlier `wheels` step on this machine
    local whl
    whl=$(ls -d .whl /tmp/whl 2>/dev/null | head -n1)
    [ -n "$whl" ] || { echo "carry .whl with the first setup (or run the wheels step)" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$whl"/*.whl || return 1
    touch /tmp/site/.refit_installed
  fi
  python3 -c "import refitplane.coordinator, refitplane.generator, vllm, nccl; print('refitplane', refitplane.generator.__file__, 'vllm', vllm.__version__)"
}

nccl_only() {
  # nccl4py alone (no vLLM yet), for the data-plane tests and model_refit
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nsite .whl/nccl4py*.whl .whl/cuda_pathfinder*.whl || return 1
  # The checkout's core (refitplane/, a namespace portion) and the services' roots.
  export PYTHONPATH=/tmp/nsite:$PWD:$PWD/services/coordinator:$PWD/services/trainer:$PWD/services/generator
}

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
