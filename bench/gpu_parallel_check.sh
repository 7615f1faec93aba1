#!/usr/bin/env bash
# TP x PP ranks on a GPU, one command (from the repo root; aimed at <= 5 minutes on one H200, not yet timed on one).
# On the device, after the same set-up as bench/gpu_check.sh:
#     bash .device/setup.sh && source /tmp/pdserve-env.sh && bash bench/gpu_parallel_check.sh
# Dry run on a CPU box (every part, ranks on CPU over gloo; about 3 minutes on 2 cores):
#     SMALL=1 bash bench/gpu_parallel_check.sh
#
#   device  torch sees CUDA (dry run: reports the CPU) and the visible GPU count
#   units   tests/test_parallel_devices.py: the rank -> device / backend rule, --debug-sync's sync + log
#   parity  tp1, tp2, pp2, tp2pp2 greedy ids == HF fp32 and == tp1 (devbench/parallel_check.py parity): on one GPU
#           the ranks share it over gloo with CUDA tensors; each of the 8 ranks must log that choice ("share"; dry
#           run: "CPU ranks: gloo")
#   debugsync  tp2pp2 under --debug-sync == HF; the ranks must log "device synchronised after all_reduce"
#   stall   tp2pp2, rank 1 SIGSTOPped mid-run: the step fails naming "rank 1 (tp 1, pp 0) stalled ... (process
#           stopped)" within --rank-timeout (3 s) + 5 s, and every rank is gone after
#   kv      prefill tp1 -> decode tp2 and pp2 through an embedded store: 72 of 77 prompt tokens loaded into the
#           ranks' shards, decode ids == HF
# parity, debugsync, stall and kv run on the first visible GPU only (their ranks must share it); graphs on all of them.
#   graphs  tp2 with decode CUDA graphs (nccl, the all-reduce inside the graph) vs tp2 --enforce-eager: the same
#           greedy ids (== HF fp32; 5 rows shrinking to 1: padded buckets, rows left by a larger batch), and tp2
#           graphs under --debug-sync (the same ids; "device synchronised after graph replay" logged); both ranks of
#           both graph runs logged "decode graphs (nccl" and "decode graphs: captured"; the median decode step ratio.
#           Needs >= 2 GPUs: with one it prints why and is SKIP (not PASS). Dry run: the CPU stand-in (the captured
#           stage function run eagerly through the replay path; ids checked, the ratio is no graph figure)
# Each part runs in the background under its own time limit; the wait loop checks the process is alive and
# reports its last lines while it runs. $OUT/summary.txt has one line per part; exit status 1 if any failed.
# PARTS (default: all) picks some: PARTS="parity stall".
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SMALL=${SMALL:-0}
ALL_PARTS="device units parity debugsync stall kv graphs"
PARTS=" ${PARTS:-$ALL_PARTS} "
for p in $PARTS; do
  [[ " $ALL_PARTS " == *" $p "* ]] || { echo "PARTS: unknown part '$p' (parts: $ALL_PARTS)" >&2; exit 2; }
done
want() { [[ "$PARTS" == *" $1 "* ]]; }
if [ "$SMALL" = 1 ]; then DEV=cpu; export TRITON_INTERPRET=1; else DEV=cuda; export TRITON_INTERPRET=0; fi
export PDSERVE_LOG_LEVEL=${PDSERVE_LOG_LEVEL:-INFO}   # the ranks log their device / backend choice
PIDS=(); RESULTS=(); FAILED=0
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -- "-$p" 2>/dev/null; done; wait 2>/dev/null; }   # each part is a group
trap cleanup EXIT
result() {   # name rc [detail]
  local status=PASS
  [ "$2" = 124 ] && status=TIMEOUT || { [ "$2" != 0 ] && status="FAIL (rc $2)"; }
  [ "$status" = PASS ] || FAILED=1
  RESULTS+=("$(printf '%-28s %-14s %s' "$1" "$status" "${3:-}")")
}
source "$(dirname "${BASH_SOURCE[0]}")/run_part.sh"   # run_part NAME LIMIT_S CMD...
py() { python3 -P "$@"; }
FIRST_GPU=${CUDA_VISIBLE_DEVICES:-0}; FIRST_GPU=${FIRST_GPU%%,*}
py1() { CUDA_VISIBLE_DEVICES=$FIRST_GPU python3 -P "$@"; }   # the shared-GPU parts: one GPU even where there are more
passes() { grep -c '^PASS' "$OUT/$1.log"; }
lines() { grep -cE '^(PASS|FAIL)' "$OUT/$1.log"; }

if want device; then
  run_part device 60 py -c "import sys, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gpus', n)
sys.exit(sys.argv[1] == 'cuda' and n < 1)" "$DEV"
  rc=$?; result device $rc "$(head -1 "$OUT/device.log")"
fi
if want units; then
  run_part units 120 py -m pytest -q -p no:cacheprovider tests/test_parallel_devices.py
  rc=$?; result "units (devices, debug-sync)" $rc "$(grep -E '(passed|failed|error)' "$OUT/units.log" | tail -1)"
fi
if want parity; then
  run_part parity 150 py1 devbench/parallel_check.py parity --device $DEV
  rc=$?
  if [ "$DEV" = cuda ]; then choice="ranks share GPUs"; else choice="CPU ranks: gloo"; fi   # one GPU: shared, gloo
  chosen=$(grep -c "$choice" "$OUT/parity.log")
  [ "$rc" = 0 ] && [ "$chosen" != 8 ] && rc=1                 # one line per rank: tp2 + pp2 + tp2pp2 = 2 + 2 + 4
  result "parity tp/pp == HF fp32" $rc "$(passes parity)/$(lines parity) layouts; $chosen rank logs say '$choice'"
fi
if want debugsync; then
  run_part debugsync 90 py1 devbench/parallel_check.py debugsync --device $DEV
  rc=$?
  syncs=$(grep -c "device synchronised after all_reduce" "$OUT/debugsync.log")
  [ "$rc" = 0 ] && [ "$syncs" = 0 ] && rc=1                       # the ranks must have logged their syncs
  result "--debug-sync tp2pp2" $rc "$(passes debugsync)/1 == HF; $syncs 'synchronised after all_reduce' log lines"
fi
if want stall; then
  run_part stall 90 py1 devbench/parallel_check.py stall --device $DEV
  rc=$?; result "stall: SIGSTOP named" $rc "$(grep -E '^(PASS|FAIL)' "$OUT/stall.log" | cut -c42-100)"
fi
if want kv; then
  run_part kv 120 py1 devbench/parallel_check.py kv --device $DEV
  rc=$?; result "kv tp1 -> tp2 / pp2" $rc "$(passes kv)/$(lines kv) layouts"
fi
if want graphs; then
  run_part graphs 240 py devbench/parallel_check.py graphs --device $DEV
  rc=$?
  if [ "$DEV" = cuda ]; then mode="decode graphs (nccl"; else mode="decode graphs (CPU ranks: the stage function"; fi
  modes=$(grep -c "$mode" "$OUT/graphs.log")
  ratio=$(grep -o 'ratio [0-9.]*' "$OUT/graphs.log" | head -1)
  if [ "$rc" = 3 ]; then                                        # fewer than 2 GPUs: said why, not a PASS
    RESULTS+=("$(printf '%-28s %-14s %s' "graphs tp2 vs eager" SKIP "$(grep '^SKIP' "$OUT/graphs.log" | cut -c7-120)")")
  else
    [ "$rc" = 0 ] && [ "$modes" != 4 ] && rc=1       # both ranks of both graph runs must have chosen the replay path
    captured=$(grep -c "decode graphs: captured" "$OUT/graphs.log")
    [ "$DEV" = cuda ] && [ "$rc" = 0 ] && [ "$captured" != 4 ] && rc=1   # ... and captured their graphs
    synced=$(grep -c "device synchronised after graph replay" "$OUT/graphs.log")
    [ "$rc" = 0 ] && [ "$synced" = 0 ] && rc=1                  # --debug-sync synchronised after the replays
    result "graphs tp2 vs eager" $rc \
      "$(passes graphs)/1 ids equal; $modes rank logs '$mode' ($captured captured, $synced replays synced);\
 decode step $ratio"
  fi
fi

{ echo "gpu_parallel_check (SMALL=$SMALL, device $DEV) $(date -u +%FT%TZ)"; printf '%s\n' "${RESULTS[@]}"; } \
  | tee "$OUT/summary.txt"
exit $FAILED
