#!/usr/bin/env bash
# The README's test command: make sure redis-server exists and answers on 127.0.0.1:6379 (installing it
# with apt-get when missing), install pdserve with its test extras into ./.venv (torch: the CPU wheel),
# run the suite, and print every skipped test with its reason (-rs). With no arguments (the whole suite, as
# CI runs it) it then checks the wheel: built, installed into a fresh venv, serving (scripts/wheel_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get (needs root)" >&2
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check "torch==2.13.0"
pip install -q --disable-pip-version-check -e ".[test,bench]"
export OMP_NUM_THREADS=1 PDSERVE_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
pytest -q -rs "$@"   # not `python -m pytest`: that puts the repo root (kernels/ ...) on sys.path
if [ $# -eq 0 ]; then
  bash scripts/wheel_check.sh
fi
