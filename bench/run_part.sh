# run_part NAME LIMIT_S CMD...: sourced by bench/gpu_parallel_check.sh (and tests/test_review41.py).
# Runs CMD (a command or a shell function) in the background into $OUT/NAME.log, in its own process group, and
# waits while it is alive, up to LIMIT_S; -> its exit status, 124 past the limit, when the whole group (the python
# under a function's subshell included) is sent SIGTERM, then SIGKILL 2 s later. Prints the log's PASS/FAIL lines
# (else its last 20 lines). A part's engine ranks are in their own session: its driver's exit ends them (lifeline).
run_part() {
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name ($(date +%T), limit ${limit}s)"
  set -m                                            # job control: the part gets a process group of its own
  "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$! start=$SECONDS rc
  set +m
  PIDS+=("$pid")
  while kill -0 "$pid" 2>/dev/null; do
    if (( SECONDS - start > limit )); then
      echo "$name: over ${limit}s; stopping process group $pid"
      kill -TERM -- "-$pid" 2>/dev/null
      for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.2; done
      kill -KILL -- "-$pid" 2>/dev/null
      wait "$pid" 2>/dev/null; grep -E '^(PASS|FAIL)' "$OUT/$name.log"; return 124
    fi
    sleep 0.2
  done
  wait "$pid"; rc=$?
  grep -E '^(PASS|FAIL)' "$OUT/$name.log" || tail -20 "$OUT/$name.log"
  return $rc
}
