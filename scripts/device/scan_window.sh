#!/usr/bin/env bash
# The sender's delta scan (issue 24), one 2-GPU device window of at most ~390 s (run from the
# checkout root, PYTHONPATH set to it, $OUT collected). Independent steps, each in its own
# process group under its own timeout (T1..T5 seconds); one failing never stops the others:
#   1. the CUDA codec tests (tests/gpu/test_delta_cuda.py): the scan with the base advanced
#      row by row (REFIT_DELTA_SCAN_UPDATE's default "rows") byte-exact on GPU
#   2. the scan's launch shapes on one GPU (benchmarks/delta_scan_gpu.py --sweep, rows
#      SWEEP_ROWS): the row update against the word-by-word one, block and warps
#   3. the executor alone, Qwen3-8B shape over NVLink, the fraction rule alone
#      (REFIT_DELTA_LINK_GBPS=off, so the deltas really run: "auto" takes the full path over
#      NVLink) with --profile: where the delta's device time goes
#   4. the same with the scan's slots and striped sums (REFIT_DELTA_PACK_CAP=64,
#      REFIT_DELTA_SUM_STRIPES=32; PACK and STRIPES override), against step 3 in one window
#   5. step 3 with the receiver's apply in its shape before 2026-11-27
#      (REFIT_DELTA_APPLY_CHUNK=4096: 254 registers per thread, not 79), the apply's A/B
# SCAN_STEPS picks and orders them (default "1 2 3 4 5"; not STEPS, which callers use for their
# own steps). One summary line per step on stdout. Step 1 ran 31 of its 52 tests in 35 s on
# 2xH100 (first compiles included): it has 90 s.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

TAG=scan
# shellcheck source=scripts/device/window_run.sh
. "$(dirname "$0")/window_run.sh"

echo "[scan] $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tr -s ' ')"
for step in ${SCAN_STEPS:-1 2 3 4 5}; do
  case $step in
    1) TAIL=4 run "${T1:-90}" pytest-delta-cuda.log python3 -m pytest tests/gpu/test_delta_cuda.py \
         -q -rf --tb=short -p no:cacheprovider ;;
    2) # shellcheck disable=SC2086 (a list of row numbers)
       TAIL=14 CUDA_VISIBLE_DEVICES=0 run "${T2:-120}" delta_scan_gpu.log python3 \
         benchmarks/delta_scan_gpu.py --sweep --rows ${SWEEP_ROWS:-0 1 2 3 4 5} --repeats 2 \
         --out "$OUT/delta_scan_gpu.json" ;;
    3) TAIL=12 REFIT_DELTA_LINK_GBPS=off run "${T3:-55}" delta_executor_off.log \
         python3 benchmarks/delta_executor_gpu.py --transports nvlink --fractions 0.01 0.05 0.2 \
         --repeats 2 --profile --out "$OUT/delta_executor_off.json" ;;
    4) TAIL=12 REFIT_DELTA_LINK_GBPS=off REFIT_DELTA_PACK_CAP=${PACK:-64} \
         REFIT_DELTA_SUM_STRIPES=${STRIPES:-32} run "${T4:-55}" delta_executor_pack.log \
         python3 benchmarks/delta_executor_gpu.py --transports nvlink --fractions 0.01 0.05 0.2 \
         --repeats 2 --profile --out "$OUT/delta_executor_pack.json" ;;
    5) TAIL=12 REFIT_DELTA_LINK_GBPS=off REFIT_DELTA_APPLY_CHUNK=4096 run "${T5:-55}" \
         delta_executor_apply4096.log python3 benchmarks/delta_executor_gpu.py --transports nvlink \
         --fractions 0.01 0.05 0.2 --repeats 2 --profile --out "$OUT/delta_executor_apply4096.json" ;;
  esac
done
echo "[scan] $(date -u +%T) done"
