#!/usr/bin/env bash
# Issue 27 on the device: CUDA IPC link copies (benchmarks/ipc_refit.py, tests/gpu/test_ipc_gpu.py).
#   GPUS=1 MODEL=qwen3-8b LEVEL=2 REPEATS=2 T_TEST=0 T_BENCH=97 bash scripts/device/ipc_window.sh
#   GPUS=2 MODEL=qwen3-8b T_TEST=60 T_BENCH=55 bash scripts/device/ipc_window.sh
# One GPU: the colocated case (T_TEST>0: the one-GPU tests first). Two GPUs: every test of
# tests/gpu/test_ipc_gpu.py (one-GPU cases on GPU 0), then cross-p2p.
# Each step runs under its own timeout, prints one summary line, and leaves its log in $OUT.
set -u
OUT=${OUT:-/tmp/out-ipc}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 REFIT_HOST=127.0.0.1 REFIT_LOG_LEVEL=INFO
export REFIT_PROFILE_DIR="$OUT/prof"; mkdir -p "$REFIT_PROFILE_DIR"
GPUS=${GPUS:-1}; MODEL=${MODEL:-qwen3-1.7b}; LEVEL=${LEVEL:-2}; REPEATS=${REPEATS:-3}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import ray; print('ray', ray.__version__)" 2>&1 | tail -1
summary() { grep -E "$2" "$OUT/$1.log" | grep -v "NUMA\|Tokenizer\|socket.cpp" | cut -c1-400 | tail -"${3:-20}"; }
if [ "$GPUS" = 1 ]; then
  if [ "${T_TEST:-0}" -gt 0 ]; then
    timeout -k 5 "$T_TEST" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ipc_gpu.py -rA \
      -k "not cross" > "$OUT/pytest_ipc.log" 2>&1
    echo "== [ipc] pytest one GPU rc=$?"; summary pytest_ipc "^(PASSED|FAILED|ERROR)|passed|failed|^E " 16
  fi
  timeout -k 5 "${T_BENCH:-150}" python3 benchmarks/ipc_refit.py --case colocated --model "$MODEL" \
    --repeats "$REPEATS" --sleep-level $LEVEL --tokens --compare-unfused --out "$OUT/colocated.json" > "$OUT/colocated.log" 2>&1
  echo "== [ipc] colocated $MODEL level $LEVEL rc=$?"; summary colocated "^\[|Traceback|Error|ipc engine" 30
else
  timeout -k 5 "${T_TEST:-60}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ipc_gpu.py -rA \
    > "$OUT/pytest_ipc.log" 2>&1
  echo "== [ipc] pytest rc=$?"; summary pytest_ipc "^(PASSED|FAILED|ERROR)|passed|failed|^E " 16
  timeout -k 5 "${T_BENCH:-55}" python3 benchmarks/ipc_refit.py --case cross-p2p --model "$MODEL" \
    --repeats "$REPEATS" --out "$OUT/cross_p2p.json" > "$OUT/cross_p2p.log" 2>&1
  echo "== [ipc] cross-p2p $MODEL rc=$?"; summary cross_p2p "^\[|Traceback|Error" 12
fi
true
