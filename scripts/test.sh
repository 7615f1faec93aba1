#!/usr/bin/env bash
# Install pdserve with its test extras into ./.venv (torch: the local CPU wheel) and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check "torch==2.13.0"
pip install -q --disable-pip-version-check -e ".[test,bench]"
export OMP_NUM_THREADS=1 PDSERVE_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
pytest -q "$@"       # not `python -m pytest`: that puts the repo root (kernels/ ...) on sys.path
