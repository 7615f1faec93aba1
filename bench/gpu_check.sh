#!/usr/bin/env bash
# The device check, one command on a lent GPU (from the repo root; about 8 minutes, not yet timed). First, here:
#     bash scripts/device_prep.sh        (.device/: the shared set-up and wheels, plus httptools and aiohttp's)
# then on the device, with .device in the run's carry:
#     bash .device/setup.sh && source /tmp/pdserve-env.sh && bash bench/gpu_check.sh
# Dry run on a CPU box, every part with tiny shapes (about 5 minutes on 2 cores; run it before each device call):
#     SMALL=1 bash bench/gpu_check.sh
#
#   1. tests, each file on its own (one failing file does not hide the next), its pytest summary reported:
#        tests/test_triton_kernels.py  the kernels vs their torch references. GPU: compiled (TRITON_INTERPRET=0,
#                                      device tensors), bf16 tensor-core dots included; dry run: interpreted on CPU
#                                      (the bf16-dot tests skip there: the interpreter's bf16 dot is wrong)
#        tests/test_decode_splits.py   the decode split-K rule; dry run: eager == the graph plan's bits, interpreted
#        tests/test_cuda_graphs.py     graph replay == eager (bitwise for a full bucket) and == --enforce-eager
#                                      (GPU; skipped in the dry run)
#        tests/test_fused_ops.py       the fused RMSNorm (+ residual add) and in-place rope kernels vs torch
#                                      (GPU: compiled, bf16 rope bit-exact; dry run: interpreted)
#   1b. the offline sm_90 compile table (devbench/compile_table.py): registers, spills and shared memory of every
#      kernel variant the planner can choose; fails on a spill or smem over 227 KB (no GPU needed: ~10 s on 16
#      cores; dry run: fp32 at head dims 128 and 256 only)
#   2. fp32 greedy ids == HF's for llama/qwen2/qwen3/mistral (devbench/hf_parity.py --check exact; Triton backend,
#      CUDA graphs on; dry run: the Triton kernels interpreted on CPU)
#   3. bf16 (the GPU default) vs HF in bf16: a 512-token greedy run per prompt, every token compared: at a
#      divergence HF's logit margin; a near-tie goes on from HF's token to the end, a larger margin fails
#      (devbench/hf_parity.py --check agreement; dry run: 48 tokens, torch backend)
#   4. kernel micro-benchmarks: decode attention and chunk gather/scatter GB/s vs the device's bandwidth; the
#      fused RMSNorm + residual add and rope vs the torch ops, us per call at a 1B Llama's shapes, eager and in
#      CUDA graphs, with a verdict for PDSERVE_FUSED_NORM / PDSERVE_FUSED_ROPE and the kernels' bits vs torch
#      (devbench/fused_bench.py: fails if the rope or the residual differs by a bit; dry run: tiny shapes,
#      interpreted; the figures mean nothing there)
#   5. the engine table (devbench/gpu_bench.py): offline tok/s, decode step at batch 256, 8k prefill, 8k store hit
#   6. `pdserve bench serve` against a colocated node and a 1P1D cluster on the same GPU (every request completes)
# Each part has its own time limit and writes under $OUT; a failing part does not stop the next. The summary at
# the end ($OUT/summary.txt) has one line per test file and part; the exit status is 1 if any failed.
# On the device a part fails when CUDA is not usable: "device" (torch.cuda.is_available() false) and each test
# file that skipped a test for want of CUDA (skips there mean the kernels never ran).
#   7. optional, not in the default: "parallel", tp/pp ranks sharing this GPU (bench/gpu_parallel_check.sh, ~5 min)
# PARTS (default: all but parallel) runs some of them, e.g. a rerun of one that failed: PARTS="parity bf16" -- names:
# device tests compile parity bf16 bench engine serve parallel; TEST_FILES (name:seconds ...) the files of "tests".
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SMALL=${SMALL:-0}
ALL_PARTS="device tests compile parity bf16 bench engine serve"
PARTS=" ${PARTS:-$ALL_PARTS} "
for p in $PARTS; do   # a misspelt part would run nothing and pass; "parallel" is known but not in the default
  [[ " $ALL_PARTS parallel " == *" $p "* ]] || { echo "PARTS: unknown part '$p' (parts: $ALL_PARTS parallel)" >&2; exit 2; }
done
TEST_FILES=${TEST_FILES:-test_triton_kernels:300 test_decode_splits:180 test_cuda_graphs:240 test_fused_ops:180}
want() { [[ "$PARTS" == *" $1 "* ]]; }
if [ "$SMALL" = 1 ]; then
  DEV=cpu; SIZE=--small; export TRITON_INTERPRET=1; BF16_BACKEND=torch; BF16_TOKENS=48
else
  DEV=cuda; SIZE=; export TRITON_INTERPRET=0; BF16_BACKEND=triton; BF16_TOKENS=512
fi
PIDS=(); RESULTS=(); FAILED=0
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
part() { echo; echo "=== $1 ($(date +%T))"; }
result() {   # name rc [detail]: one summary line; rc 0 passes, 124 is the part's time limit
  local status=PASS
  [ "$2" = 124 ] && status="TIMEOUT" || { [ "$2" != 0 ] && status="FAIL (rc $2)"; }
  [ "$status" = PASS ] || FAILED=1
  RESULTS+=("$(printf '%-32s %-14s %s' "$1" "$status" "${3:-}")")
}
py() { python3 -P "$@"; }   # -P: the repo root is not on sys.path (its kernels/ would shadow HF's `kernels`)

if want device; then
part "device"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
else
  echo "no nvidia-smi (CPU dry run)" | tee "$OUT/gpu.txt"
fi
py -c "import sys, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
                                   'cuda', torch.cuda.is_available())
sys.exit(sys.argv[1] == 'cuda' and not torch.cuda.is_available())" "$DEV"   # on the device: CUDA must work
rc=$?
result device $rc "$([ $rc = 1 ] && echo "torch.cuda.is_available() is False")"
fi

if want tests; then
part "tests, one file at a time (TRITON_INTERPRET=$TRITON_INTERPRET)"
for spec in $TEST_FILES; do
  name=${spec%%:*}
  echo "--- tests/$name.py"
  timeout "${spec##*:}" python3 -P -m pytest -q -p no:cacheprovider -rs "tests/$name.py" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -15 "$OUT/$name.log"
  detail=$(grep -E '(passed|failed|skipped|error|no tests ran).* in ' "$OUT/$name.log" | tail -1)
  nocuda=$(grep -Ec '^SKIPPED.*(no CUDA device|need a CUDA device|needs a GPU)' "$OUT/$name.log")
  if [ "$DEV" = cuda ] && [ "$rc" = 0 ] && [ "$nocuda" != 0 ]; then   # on the device nothing may skip for want of it
    rc=1; detail="$detail; $nocuda skip line(s) for want of CUDA"
  fi
  result "tests/$name.py" $rc "$detail"
done
fi

if want compile; then
part "offline sm_90 compile table"
COMPILE_ARGS=; [ "$SMALL" = 1 ] && COMPILE_ARGS="--dtypes float32 --head-dims 128,256 --qpk 1,4"
timeout 300 python3 -P devbench/compile_table.py $COMPILE_ARGS --markdown "$OUT/compile_table.md" \
  > "$OUT/compile_table.log" 2>&1
rc=$?
tail -1 "$OUT/compile_table.log"
result "offline sm_90 compile table" $rc "$(tail -1 "$OUT/compile_table.log" | cut -c1-60)"
fi

if want parity; then
part "fp32 greedy parity vs HF"
timeout 240 python3 devbench/hf_parity.py --device $DEV --dtype float32 \
  --check exact --attention-backend triton 2>&1 | grep -v "it/s" | tee "$OUT/parity.txt"
result "fp32 parity vs HF" "${PIPESTATUS[0]}" "$(grep -c EQUAL "$OUT/parity.txt") of 4 archs EQUAL"
fi

if want bf16; then
part "bf16 greedy agreement vs HF ($BF16_TOKENS tokens, $BF16_BACKEND backend)"
timeout 240 python3 devbench/hf_parity.py --device $DEV --dtype bfloat16 --check agreement --archs llama,qwen3 \
  --attention-backend $BF16_BACKEND --max-tokens $BF16_TOKENS 2>&1 | grep -v "it/s" | tee "$OUT/parity_bf16.txt"
rc=${PIPESTATUS[0]}
count() { grep -c "$1" "$OUT/parity_bf16.txt"; }
result "bf16 agreement vs HF" "$rc" "$(count ': EQUAL') EQUAL, $(count NEAR-TIE) NEAR-TIE, $(count DIVERGED) DIVERGED"
fi

if want bench; then
part "kernel micro-benchmarks"
timeout 120 python3 devbench/kernel_bench.py $SIZE --output "$OUT/kernels.json" 2>&1 | tail -12 | tee "$OUT/kernels.txt"
result "kernel micro-benchmarks" "${PIPESTATUS[0]}"
timeout 150 python3 devbench/fused_bench.py $SIZE --output "$OUT/fused.json" 2>&1 | tail -24 | tee "$OUT/fused.txt"
result "fused norm/rope bench" "${PIPESTATUS[0]}" "$(grep -h '^verdict' "$OUT/fused.txt" | cut -c9- | paste -sd' ')"
fi

MODEL=/tmp/gpu-bench-model; [ "$SMALL" = 1 ] && MODEL=/tmp/gpu-bench-small
if want engine; then
part "engine table"
timeout 200 python3 devbench/gpu_bench.py --device $DEV $SIZE --model-dir $MODEL --output "$OUT/engine.json" 2>&1 \
  | grep -v "it/s" | tail -12 | tee "$OUT/engine.txt"
result "engine table" "${PIPESTATUS[0]}"
fi

wait_http() {   # url pid seconds: 0 once the url answers, 1 if the process died or time ran out
  local url=$1 pid=$2 t=$3
  for _ in $(seq "$t"); do
    kill -0 "$pid" 2>/dev/null || { echo "process $pid died"; return 1; }
    py -c "import httpx, sys; sys.exit(httpx.get(sys.argv[1], timeout=2).status_code != 200)" "$url" \
      >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "timeout waiting for $url"; return 1
}
serve_bench() {   # name port: the benchmark, then one summary line from its JSON (every request completed?)
  rm -f "$OUT/serve_$1.json"
  timeout 60 pdserve bench serve --base-url "http://127.0.0.1:$2" --model "$MODEL" \
    --served-model-name "$(basename "$MODEL")" --dataset-name random \
    --random-input-len ${IN:-512} --random-output-len ${OUTLEN:-128} --num-prompts ${NP:-128} --ignore-eos \
    --disable-tqdm --save-result --result-dir "$OUT" --result-filename "serve_$1.json" 2>&1 | tail -14 | tee "$OUT/serve_$1.txt"
  local rc=${PIPESTATUS[0]}
  local summary
  summary=$(py - "$OUT/serve_$1.json" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d['completed']}/{d['num_prompts']} completed, {d['failed']} failed, {d['output_throughput']:.0f} out tok/s")
sys.exit(d["failed"] or d["completed"] != d["num_prompts"])
PY
) || { [ "$rc" = 0 ] && rc=1; }
  result "bench serve $1" "$rc" "$summary"
}
if want serve; then
part "bench serve: colocated and 1P1D"
[ "$SMALL" = 1 ] && { IN=32; OUTLEN=8; NP=8; }
NODE_FLAGS="--device $DEV --dtype $([ "$SMALL" = 1 ] && echo float32 || echo bfloat16) --max-num-seqs 256 --max-model-len 1024"
pdserve node --model "$MODEL" --port 8311 $NODE_FLAGS --kv-cache-memory-bytes $((8 << 30)) > "$OUT/node.log" 2>&1 &
NODE=$!; PIDS+=("$NODE")
if wait_http http://127.0.0.1:8311/health "$NODE" 120; then serve_bench colocated 8311
else result "bench serve colocated" 1 "the node did not come up: $OUT/node.log"; fi
kill "$NODE" 2>/dev/null; wait "$NODE" 2>/dev/null
pdserve serve --model "$MODEL" --port 8310 $NODE_FLAGS > "$OUT/cluster.log" 2>&1 &
CLUSTER=$!; PIDS+=("$CLUSTER")
if wait_http http://127.0.0.1:8310/health "$CLUSTER" 150; then serve_bench 1p1d 8310
else result "bench serve 1p1d" 1 "the cluster did not come up: $OUT/cluster.log"; fi
kill -INT "$CLUSTER" 2>/dev/null; sleep 3; kill "$CLUSTER" 2>/dev/null; wait "$CLUSTER" 2>/dev/null
fi

if want parallel; then   # optional (PARTS="... parallel"): tp/pp ranks on this GPU, bench/gpu_parallel_check.sh
part "tp x pp ranks on one GPU (bench/gpu_parallel_check.sh)"
timeout 330 env -u PARTS OUT="$OUT/parallel" SMALL="$SMALL" bash bench/gpu_parallel_check.sh > "$OUT/parallel.log" 2>&1
rc=$?
tail -7 "$OUT/parallel.log"
result "tp x pp on one GPU" $rc "$(grep -c PASS "$OUT/parallel/summary.txt" 2>/dev/null) parts passed; $OUT/parallel/"
fi

echo; echo "=== summary ($(date +%T), $([ "$SMALL" = 1 ] && echo "CPU dry run" || echo "$DEV")); results in $OUT"
printf '%s\n' "${RESULTS[@]}" | tee "$OUT/summary.txt"
exit $FAILED
