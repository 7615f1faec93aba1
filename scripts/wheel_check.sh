#!/usr/bin/env bash
# What ships is what is tested: build pdserve's wheel, install it into a fresh venv (not editable: no checkout on
# sys.path), and serve one completion through `pdserve serve` with the C kernels built from the wheel's own
# sources (each node must log attention=cpu). Run by scripts/test.sh (the README's test command) after pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d /tmp/pdserve-wheel-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
echo "wheel check: building the wheel from the checkout's files (no build/ left over from an earlier build) ..."
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$WORK/src"
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/dist" "$WORK/src" 2>&1 | grep -v "^WARNING: Location" || true
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"$WORK/venv/bin/pip" install -q --disable-pip-version-check "$WORK"/dist/pdserve-*.whl 2>&1 | grep -v "^WARNING: Location" || true
cd "$WORK"                                    # nothing of the checkout on sys.path
PDSERVE_CACHE_DIR="$WORK/cache" OMP_NUM_THREADS=1 "$WORK/venv/bin/python" -P "$ROOT/scripts/wheel_serve.py" "$WORK"
