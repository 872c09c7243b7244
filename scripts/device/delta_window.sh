#!/usr/bin/env bash
# Delta refits on 2 GPUs (issue 24), one device window (run from the checkout root, PYTHONPATH
# set to it, $OUT collected). Independent steps, each in its own process group under its own
# timeout (T1..T4 seconds; whatever a step leaves running is killed with its group):
#   1. executor delta refits over NCCL, byte-exact (whole and resharded receives)
#   3. delta refits into live vLLM (data plane, trigger -> COMMITTED, in-worker exactness);
#      VLLM_TRANSPORTS (default nvlink), UPDATES (default "1% 20%")
#   2. the executor alone, Qwen3-8B shape: full vs delta per changed fraction over NVLink and
#      NCCL's socket transport, both ends' reports and a profile of a 1 % delta refit;
#      EXEC_TRANSPORTS (default "nvlink net"), EXEC_REPEATS (default 2)
#   4. the CUDA codec tests
# STEPS picks and orders them (default "1 3 2 4").
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/profile"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0

TAG=delta
# shellcheck source=scripts/device/window_run.sh
. "$(dirname "$0")/window_run.sh"

echo "[delta] $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tr -s ' ')"
for step in ${STEPS:-1 3 2 4}; do
  case $step in
    1) run "${T1:-35}" pytest-delta-executor.log python3 -m pytest \
         tests/gpu/test_delta_executor_gpu.py -q -rA --tb=short -p no:cacheprovider ;;
    3) REFIT_PROFILE_DIR="$OUT/profile" run "${T3:-75}" delta_refit_gpu.log \
         python3 benchmarks/delta_refit_gpu.py --transports ${VLLM_TRANSPORTS:-nvlink} \
         --repeats 1 --updates ${UPDATES:-1% 20%} --no-ceiling --no-tokens \
         --out "$OUT/delta_refit_gpu.json" ;;
    2) run "${T2:-50}" delta_executor_gpu.log python3 benchmarks/delta_executor_gpu.py \
         --transports ${EXEC_TRANSPORTS:-nvlink net} --repeats "${EXEC_REPEATS:-2}" --profile \
         --out "$OUT/delta_executor_gpu.json" ;;
    4) run "${T4:-15}" pytest-delta-cuda.log python3 -m pytest tests/gpu/test_delta_cuda.py \
         -q -x -p no:cacheprovider ;;
  esac
done
echo "[delta] $(date -u +%T) done"
