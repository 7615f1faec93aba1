#!/usr/bin/env bash
# Order independence of the suite (issue 15), the two checks in one go:
#   1. the whole suite once in random order (pytest-randomly, installed into a throwaway directory, never into
#      .venv: CI runs in file order), with the seed printed so that a failing order can be repeated;
#   2. every tests/test_*.py file alone, in file order.
# Run it after scripts/test.sh has made .venv and Redis. It takes about twice the suite's time.
#
#   bash scripts/test_order.sh [--seed N] [--only random|files]
#
# Repeat an order: PYTHONPATH=<dir with pytest-randomly> pytest -p randomly --randomly-seed=N  (the lines
# printed below say which).
set -uo pipefail
cd "$(dirname "$0")/.."

seed="$(( (RANDOM << 15) | RANDOM ))"
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --seed) seed="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    *) echo "usage: $0 [--seed N] [--only random|files]" >&2; exit 2 ;;
  esac
done

redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || { echo "no Redis on 127.0.0.1:6379: run scripts/test.sh first" >&2; exit 2; }
. .venv/bin/activate
export OMP_NUM_THREADS=1 PDSERVE_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
logs="$(mktemp -d /tmp/pdserve-test-order.XXXXXX)"
status=0

if [ "$only" != "files" ]; then
  plugin="$logs/plugins"
  pip install -q --disable-pip-version-check --no-deps --target "$plugin" pytest-randomly || exit 2
  echo "== random order: --randomly-seed=$seed (repeat: PYTHONPATH=$plugin pytest -p randomly --randomly-seed=$seed)"
  start=$SECONDS
  PYTHONPATH="$plugin${PYTHONPATH:+:$PYTHONPATH}" pytest -q -rs -p randomly --randomly-seed="$seed" 2>&1 |
    tee "$logs/random.log" | tail -n 25
  rc=${PIPESTATUS[0]}
  echo "== random order, seed $seed: exit $rc in $(( SECONDS - start )) s (log: $logs/random.log)"
  [ "$rc" -eq 0 ] || status=1
fi

if [ "$only" != "random" ]; then
  failed=()
  for f in tests/test_*.py; do
    start=$SECONDS
    log="$logs/$(basename "$f" .py).log"
    pytest -q -p no:randomly "$f" >"$log" 2>&1
    rc=$?
    printf '%-45s exit %d  %4d s  %s\n' "$f" "$rc" "$(( SECONDS - start ))" "$(tail -n 1 "$log")"
    # 5: no tests collected (a file whose every test is deselected or skipped at collection) is not a failure
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || failed+=("$f")
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "== files that fail alone (logs in $logs): ${failed[*]}"
    status=1
  else
    echo "== every file passes alone"
  fi
fi
exit $status
