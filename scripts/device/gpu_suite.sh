#!/usr/bin/env bash
# The whole tests/gpu suite on a 2-GPU machine (nvidia-h100-x2) in three device calls of at
# most CALL_S seconds each (default 530: a call may run 540), for one session's device time.
# One-GPU tests run in two lanes at once (CUDA_VISIBLE_DEVICES=0 and =1, one pytest each);
# two-GPU tests run alone. Each lane's pytest log and junit XML go to $OUT.
#
# Prepare and send as for gpu_session.sh (wheels, stage p1, stage p2), then:
#     carry the last stage folder (the one with install_vllm_on_device.sh, MANIFEST and the
#     extra wheels; p3 or p4 as stage_vllm.sh split it):   bash scripts/device/gpu_suite.sh 1
#     (nothing carried):   bash scripts/device/gpu_suite.sh 2
#     (nothing carried):   bash scripts/device/gpu_suite.sh 3
# On a one-GPU machine (nvidia-h100-x1, counted at part of its time) calls 1 and 2 run their
# two lanes one after the other on GPU 0 (LANES_ONLY="1.1" picks lanes); call 3 needs two GPUs.
# Here (no GPU): `bash scripts/device/gpu_suite.sh check` collects each lane's selection and
# fails unless together they hold every test of tests/gpu exactly once.
#
# Measured on 2xH100 (2026-11-26, eighth session; lanes 1.0 329 s, 1.1 226 s, 2.0 305 s,
# 2.1 383 s, 3.2gpu over 293 s): call 1 347 s, call 2 403 s, call 3 ~310 s — ~18 min of
# device time for the suite, plus the machine's start and the staging calls. pytest --durations=0 in each log gives the next
# estimate (the first mode of a fresh-load case carries its checkpoint and fresh engine).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/device/session_setup.sh
. scripts/device/session_setup.sh
began=$(date +%s)

FRESH=tests/gpu/test_fresh_load_gpu.py
COVERAGE=tests/gpu/test_model_coverage_gpu.py
# A lane is one pytest command line (its selection), by name "CALL.LANE"; lane 0 runs on
# GPU 0, lane 1 on GPU 1, lane "2gpu" on both. The coverage cases run in the same pytest as
# their fresh-load case, after it: its "auto" engine's reload report is theirs (no engine).
lane_args() {  # ARGS=(the pytest selection of lane $1)
  case "$1" in
    # ~200 s: qwen3-moe-fp8 (3 engines, ~120 s), then the draft_model draft (~59 s); the mtp
    # draft runs in lane 2.0 (beside lane 1.1 on the same host's CPUs, the three cases ran
    # past the call's bound twice). The lightest call first: it also installs vLLM.
    1.0) ARGS=("$FRESH" tests/gpu/test_draft_gpu.py -k "qwen3-moe-fp8 or draft_model") ;;
    # ~200 s: the data-plane kernels and one-GPU CUDA IPC (~81 s), then qwen3-fp8-kv's
    # fresh-load and coverage cases (3 small engines, ~100 s).
    1.1) ARGS=(tests/gpu/test_checksum_cuda.py tests/gpu/test_delta_cuda.py
      tests/gpu/test_ipc_gpu.py "$FRESH" "$COVERAGE"
      -k "qwen3-fp8-kv or not (fresh_load or model_coverage or cross_gpu)") ;;
    # ~380 s: the checkpoint and 3 engines (fresh, auto, staged) of the DeepSeek-V2-Lite shape
    # (293 s in the fifteenth session), then the mtp draft (~86 s).
    2.0) ARGS=("$FRESH" "$COVERAGE" tests/gpu/test_draft_gpu.py -k "deepseek-v2-lite or mtp") ;;
    # ~285 s: the same for the Nemotron-H shape.
    2.1) ARGS=("$FRESH" "$COVERAGE" -k nemotron-h) ;;
    # ~300 s (285 s measured): trainer on GPU 0, vLLM on GPU 1.
    3.2gpu) ARGS=(tests/gpu/test_vllm_refit_gpu.py tests/gpu/test_vllm_fp8_refit_gpu.py
      tests/gpu/test_fused_runs_gpu.py tests/gpu/test_nccl_transport.py
      tests/gpu/test_delta_executor_gpu.py
      tests/gpu/test_ipc_gpu.py::test_cross_gpu_ipc_arrives_bit_exact) ;;
    *) return 1 ;;
  esac
}
LANES="1.0 1.1 2.0 2.1 3.2gpu"

run_lane() {  # run_lane NAME SECONDS: the lane's pytest in its own process group, on its GPU(s)
  local name=$1 secs=$2 gpu
  gpu=${name#*.}
  lane_args "$name"
  local visible=0,1
  [ "$gpu" = 2gpu ] || visible=$gpu
  [ "$gpus" -ge 2 ] || visible=0  # one GPU: every one-GPU lane runs on it, one at a time
  echo "[suite $name] $(date -u +%T) GPU $visible, ${secs}s: pytest ${ARGS[*]}"
  CUDA_VISIBLE_DEVICES=$visible setsid timeout -k 10 "$secs" python3 -m pytest -v -rs \
    -p no:cacheprovider --durations=0 --basetemp="/tmp/gpu-suite/$name" \
    --junitxml="$OUT/junit-$name.xml" "${ARGS[@]}" >"$OUT/pytest-$name.log" 2>&1 &
  local pid=$!
  wait "$pid"
  local rc=$?
  kill -9 -- "-$pid" 2>/dev/null  # an engine a killed pytest left behind
  echo "[suite $name] $(date -u +%T) rc=$rc$([ "$rc" = 124 ] && echo ' (timed out)')"
  # what did not pass, and pytest's verdict line (every result is in the log and the junit)
  grep -E " (FAILED|ERROR)( |$)|^(FAILED|ERROR|SKIPPED) |^E |[0-9]+ (passed|failed|error)" \
    "$OUT/pytest-$name.log" | grep -v "^(EngineCore\|^(Worker" | cut -c1-300 | tail -30
  return "$rc"
}

check() {  # every test of tests/gpu in exactly one lane (collection only: runs anywhere)
  local lane all
  all=$(python3 -m pytest -q -p no:cacheprovider --collect-only tests/gpu 2>/dev/null | grep '::' | sort)
  : >/tmp/gpu-suite-lanes.txt
  for lane in $LANES; do
    lane_args "$lane"
    python3 -m pytest -q -p no:cacheprovider --collect-only "${ARGS[@]}" 2>/dev/null \
      | grep '::' | tee -a /tmp/gpu-suite-lanes.txt | wc -l | sed "s/^/[suite $lane] tests: /"
  done
  local missing twice
  missing=$(comm -23 <(echo "$all") <(sort -u /tmp/gpu-suite-lanes.txt))
  twice=$(sort /tmp/gpu-suite-lanes.txt | uniq -d)
  echo "[suite] $(echo "$all" | grep -c .) tests in tests/gpu"
  [ -z "$missing" ] || { echo "[suite] in no lane:"; echo "$missing"; }
  [ -z "$twice" ] || { echo "[suite] in two lanes:"; echo "$twice"; }
  [ -z "$missing$twice" ]
}

call=${1:-}
case "$call" in
  check) check; exit $? ;;
  1 | 2 | 3) ;;
  *) echo "usage: $0 1|2|3 (on the device, in order, one device call each) | check" >&2; exit 2 ;;
esac
# The checkout's code first (the installed wheels may be older, and hold only the generator's
# distribution): setup's import check and spawned workers see it.
export PYTHONPATH=$PWD:$PWD/services/coordinator:$PWD/services/trainer:$PWD/services/generator${PYTHONPATH:+:$PYTHONPATH}
setup || exit 1
# setup put /tmp/site first: the checkout's code must win over the installed generator wheel
export PYTHONPATH=$PWD:$PWD/services/coordinator:$PWD/services/trainer:$PWD/services/generator:$PYTHONPATH
mkdir -p /tmp/gpu-suite  # pytest makes --basetemp, not its parent
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
left=$(( ${CALL_S:-530} - ($(date +%s) - began) - 15 ))  # 15 s for the last lane's kill and tails
echo "[suite] call $call: $left s for its lanes"
gpus=$(nvidia-smi -L | grep -c '^GPU')
rc=0
if [ "$call" = 3 ]; then
  [ "$gpus" -ge 2 ] || { echo "[suite] call 3 needs two GPUs, this machine has $gpus" >&2; exit 2; }
  run_lane 3.2gpu "$left" || rc=1
elif [ "$gpus" -lt 2 ]; then
  for lane in ${LANES_ONLY:-$call.0 $call.1}; do
    run_lane "$lane" $(( ${CALL_S:-530} - ($(date +%s) - began) - 15 )) || rc=1
  done
else
  run_lane "$call.0" "$left" >"$OUT/suite-$call.0.txt" 2>&1 &
  first=$!
  run_lane "$call.1" "$left" >"$OUT/suite-$call.1.txt" 2>&1 &
  second=$!
  wait "$first" || rc=1
  wait "$second" || rc=1
  cat "$OUT/suite-$call.0.txt" "$OUT/suite-$call.1.txt"
fi
echo "[suite] call $call done in $(( $(date +%s) - began )) s, rc=$rc"
exit "$rc"
