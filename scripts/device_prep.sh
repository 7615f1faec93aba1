#!/usr/bin/env bash
# Prepares .device/ for a GPU call (run here, before the device tool's `run`, from the repository root):
#     bash scripts/device_prep.sh            then, on the device:  bash .device/setup.sh && source /tmp/pdserve-env.sh
# It copies the shared set-up script and cp312 wheels (../shared/device, ../shared/device-wheels) and adds the
# cp312 wheels of dependencies the shared folder lacks (EXTRA below: blake3, the store's keyed seals; httptools, the
# proxy's HTTP parser, and
# aiohttp's stack for the bench client and tests), downloaded from the package index without their
# dependencies. .device/ is git-ignored: name it in the run's `carry`.
set -euo pipefail
SHARED=${SHARED:-../shared}
EXTRA="blake3 xgrammar apache-tvm-ffi httptools aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs idna typing_extensions"
rm -rf .device && mkdir -p .device
cp "$SHARED/device/setup.sh" .device/
cp -r "$SHARED/device-wheels" .device/
chmod -R u+w .device
for pkg in $EXTRA; do
  if ! ls .device/device-wheels | grep -qi "^${pkg//-/_}-"; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .device/device-wheels "$pkg"
  fi
done
ls .device/device-wheels | wc -l | xargs echo "wheels in .device/device-wheels:"
