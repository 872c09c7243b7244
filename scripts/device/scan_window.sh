#!/usr/bin/env bash
# Delta refits over NVLink after the "auto" link decision and the scan settings (issue 24),
# one 2-GPU device window of at most ~5 min (run from the checkout root, PYTHONPATH set to
# it, $OUT collected). Independent steps, each in its own process group under its own
# timeout (T1..T4 seconds):
#   1. the CUDA codec tests and the executor's delta refits between the GPUs, byte-exact
#      (with the link decision's case: a link no delta can beat runs the full path)
#   2. the executor alone, Qwen3-8B shape over NVLink, the old decision
#      (REFIT_DELTA_LINK_GBPS=off: the fraction rule alone) — the baseline
#   3. the same with the link decision (rate measured from the full refits): over NVLink the
#      full refits agree that no delta can win (`delta_cost.never_pays`), so every delta row
#      runs the full path ("1 full-path link(s), 0 header table(s)"), within ~1 ms of full
#   4. the scan's launch shapes and checksum modes on one GPU (benchmarks/delta_scan_gpu.py)
# STEPS picks and orders them (default "1 2 3 4").
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

TAG=scan
# shellcheck source=scripts/device/window_run.sh
. "$(dirname "$0")/window_run.sh"

echo "[scan] $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tr -s ' ')"
fractions=(--transports nvlink --fractions 0.01 0.05 0.2 --repeats 2)
for step in ${STEPS:-1 2 3 4}; do
  case $step in
    1) run "${T1:-90}" pytest-delta-gpu.log python3 -m pytest tests/gpu/test_delta_cuda.py \
         tests/gpu/test_delta_executor_gpu.py -q -rA --tb=short -p no:cacheprovider ;;
    2) REFIT_DELTA_LINK_GBPS=off run "${T2:-50}" delta_executor_off.log \
         python3 benchmarks/delta_executor_gpu.py "${fractions[@]}" \
         --out "$OUT/delta_executor_off.json" ;;
    3) run "${T3:-50}" delta_executor_auto.log python3 benchmarks/delta_executor_gpu.py \
         "${fractions[@]}" --out "$OUT/delta_executor_auto.json" ;;
    4) TAIL=14 run "${T4:-100}" delta_scan_gpu.log python3 benchmarks/delta_scan_gpu.py \
         --sweep --repeats 3 --out "$OUT/delta_scan_gpu.json" ;;
  esac
done
echo "[scan] $(date -u +%T) done"
