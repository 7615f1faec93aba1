#!/usr/bin/env bash
# The device check, one command on a lent GPU (from the repo root; about 6 minutes). First, here:
#     bash scripts/device_prep.sh        (.device/: the shared set-up and wheels, plus httptools and aiohttp's)
# then on the device, with .device in the run's carry:
#     bash .device/setup.sh && source /tmp/pdserve-env.sh && bash bench/gpu_check.sh
# Dry run on a CPU box (tiny shapes, the same code paths where they exist):  SMALL=1 bash bench/gpu_check.sh
#   1. the Triton kernel tests compiled for the device (no interpreter) and the CUDA-graph tests
#   2. greedy ids on CUDA (fp32, Triton backend, CUDA graphs on) == HF on CUDA for llama/qwen2/qwen3/mistral
#   3. kernel micro-benchmarks: decode attention and chunk gather/scatter GB/s vs the device's bandwidth
#   4. the engine table (devbench/gpu_bench.py): offline tok/s, decode step at batch 256, 8k prefill, 8k store hit
#   5. `pdserve bench serve` against a colocated node and a 1P1D cluster on the same GPU
# Each part has its own time limit and writes under $OUT; a failing part does not stop the next.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SMALL=${SMALL:-0}
if [ "$SMALL" = 1 ]; then DEV=cpu; SIZE=--small; export TRITON_INTERPRET=1; else DEV=cuda; SIZE=; export TRITON_INTERPRET=0; fi
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
part() { echo; echo "=== $1 ($(date +%T))"; }

part "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

part "kernel + graph tests"
if [ "$SMALL" = 1 ]; then TESTS=tests/test_cuda_graphs.py; else TESTS="tests/test_triton_kernels.py tests/test_cuda_graphs.py"; fi
timeout 150 python3 -m pytest -q -x -p no:cacheprovider $TESTS -rs 2>&1 | tail -15 | tee "$OUT/tests.txt"

part "greedy parity vs HF"
timeout 120 python3 - "$DEV" <<'PY' 2>&1 | grep -v "it/s" | tee "$OUT/parity.txt"
import sys, torch
sys.path.insert(0, "tests")
from hf_reference import random_prompt
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoints.tiny_model import make_tiny_model
from transformers import AutoModelForCausalLM
dev = sys.argv[1]
backend = "triton"
for arch in ("llama", "qwen2", "qwen3", "mistral"):
    d = make_tiny_model(f"/tmp/gm/{arch}", arch=arch, seed=0)
    llm = LLM(str(d), device=dev, dtype="float32", attention_backend=backend, max_num_seqs=16, max_model_len=512)
    graphs = llm.engine.runner.graphs is not None
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).to(dev).eval()
    prompts = [random_prompt(ref.config.vocab_size, n, seed=n) for n in (1, 17, 300)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ok = True
    for p, o in zip(prompts, outs):
        h = ref.generate(torch.tensor([p], device=dev), attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev),
                         max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        ok &= o.token_ids == h
    print(f"{dev} parity {arch} (backend {backend}, graphs {'on' if graphs else 'off'}): {'EQUAL' if ok else 'DIFFERENT'}")
    llm.shutdown()
PY

if [ "$SMALL" != 1 ]; then
  part "kernel micro-benchmarks"
  timeout 90 python3 devbench/kernel_bench.py --output "$OUT/kernels.json" 2>&1 | tail -12 | tee "$OUT/kernels.txt"
fi

part "engine table"
MODEL=/tmp/gpu-bench-model; [ "$SMALL" = 1 ] && MODEL=/tmp/gpu-bench-small
timeout 200 python3 devbench/gpu_bench.py --device $DEV $SIZE --model-dir $MODEL --output "$OUT/engine.json" 2>&1 \
  | grep -v "it/s" | tail -12 | tee "$OUT/engine.txt"

part "bench serve: colocated and 1P1D"
wait_http() {   # url pid seconds: 0 once the url answers, 1 if the process died or time ran out
  local url=$1 pid=$2 t=$3
  for _ in $(seq "$t"); do
    kill -0 "$pid" 2>/dev/null || { echo "process $pid died"; return 1; }
    python3 -c "import httpx, sys; sys.exit(httpx.get(sys.argv[1], timeout=2).status_code != 200)" "$url" \
      >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "timeout waiting for $url"; return 1
}
serve_bench() {   # name port
  timeout 60 pdserve bench serve --base-url "http://127.0.0.1:$2" --model "$MODEL" \
    --served-model-name "$(basename "$MODEL")" --dataset-name random \
    --random-input-len ${IN:-512} --random-output-len ${OUTLEN:-128} --num-prompts ${NP:-128} --ignore-eos \
    --disable-tqdm --save-result --result-dir "$OUT" --result-filename "serve_$1.json" 2>&1 | tail -14 | tee "$OUT/serve_$1.txt"
}
[ "$SMALL" = 1 ] && { IN=32; OUTLEN=8; NP=8; }
NODE_FLAGS="--device $DEV --dtype $([ "$SMALL" = 1 ] && echo float32 || echo bfloat16) --max-num-seqs 256 --max-model-len 1024"
pdserve node --model "$MODEL" --port 8311 $NODE_FLAGS --kv-cache-memory-bytes $((8 << 30)) > "$OUT/node.log" 2>&1 &
NODE=$!; PIDS+=("$NODE")
if wait_http http://127.0.0.1:8311/health "$NODE" 120; then serve_bench colocated 8311; fi
kill "$NODE" 2>/dev/null; wait "$NODE" 2>/dev/null
pdserve serve --model "$MODEL" --port 8310 $NODE_FLAGS > "$OUT/cluster.log" 2>&1 &
CLUSTER=$!; PIDS+=("$CLUSTER")
if wait_http http://127.0.0.1:8310/health "$CLUSTER" 150; then serve_bench 1p1d 8310; fi
kill -INT "$CLUSTER" 2>/dev/null; sleep 3; kill "$CLUSTER" 2>/dev/null; wait "$CLUSTER" 2>/dev/null
echo; echo "=== done ($(date +%T)); results in $OUT"
