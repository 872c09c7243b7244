# Sourced by the device window scripts: `run SECONDS LOG COMMAND...` runs the command in its
# own process group under a timeout, its output to $OUT/LOG, kills what it left running, and
# prints the log's tail (TAIL lines, default 16) without the noisy lines; TAG names the window.
run() {
  local secs=$1 log=$OUT/$2
  shift 2
  echo "[$TAG] $(date -u +%T) ${secs}s: $*"
  setsid timeout -k 5 "$secs" "$@" >"$log" 2>&1 &
  local pid=$!
  wait "$pid"
  echo "[$TAG] rc=$?"
  kill -9 -- "-$pid" 2>/dev/null
  grep -v "^(EngineCore\|^INFO\|^WARNING\|^\[rank\|^(Worker\|^\[W[0-9]\|^  warn" "$log" | tail -"${TAIL:-16}"
}
