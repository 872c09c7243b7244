#!/usr/bin/env bash
# The delta-refit GPU session (issue 24), run from a copy of the checkout on a 2-GPU machine:
#     stage PART     (carry .stage/PART[, .whl])  keep a piece of the vLLM wheel in /tmp/vstage
#     run [ARGS]     (carry .stage/p4 and this checkout, with its generator wheel in .gwhl/)
#                    install vLLM + wheels, run the CUDA delta tests, then
#                    benchmarks/delta_refit_gpu.py ARGS; logs and JSON to $OUT
# Steps already done on a warm machine (/tmp/vstage/pK, /tmp/site/.vllm_installed) are skipped.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
root=$(cd "$(dirname "$0")/../.." && pwd)   # this checkout (.dev/delta on the device)
repo=$(cd "$root/../.." && pwd)              # the carried repository root (.stage, .whl)
step=${1:-}
shift || true
echo "[delta] $(date -u +%FT%TZ) step=$step; staged: $(ls /tmp/vstage 2>/dev/null | tr '\n' ' ')"
case "$step" in
  stage)
    mkdir -p /tmp/vstage
    for part in "$@"; do
      [ -d "$repo/.stage/$part" ] && cp -a "$repo/.stage/$part" /tmp/vstage/
    done
    [ -d "$repo/.whl" ] && { rm -rf /tmp/whl; cp -a "$repo/.whl" /tmp/whl; }
    du -sb /tmp/vstage/* ; ls /tmp/whl 2>/dev/null | wc -l
    ;;
  run)
    cd "$repo" || exit 1
    # shellcheck disable=SC1091
    . /tmp/vstage/p4/install_vllm_on_device.sh 2>/dev/null || . .stage/p4/install_vllm_on_device.sh || exit 1
    if [ ! -f /tmp/site/.refit_installed ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/whl/*.whl || exit 1
      touch /tmp/site/.refit_installed
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$root"/.gwhl/*.whl || exit 1
    cd "$root" || exit 1
    export PYTHONPATH=$PWD:$PWD/services/coordinator:$PWD/services/trainer:$PWD/services/generator:/tmp/site
    nvidia-smi --query-gpu=index,name,memory.total --format=csv
    nvidia-smi topo -m | head -4
    if [ "${DELTA_TESTS:-1}" = 1 ]; then
      timeout 240 python3 -m pytest tests/gpu/test_delta_cuda.py -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/pytest-delta-cuda.log" | tail -5
    fi
    python3 benchmarks/delta_refit_gpu.py --out "$OUT/delta_refit_gpu.json" "$@" 2>&1 \
      | tee "$OUT/delta_refit_gpu.log" | grep -v "^(EngineCore\|^INFO\|^WARNING\|^\[rank" ;
    exit "${PIPESTATUS[0]}"
    ;;
  *) echo "usage: $0 stage PART... | run [benchmark args]" >&2; exit 2 ;;
esac
