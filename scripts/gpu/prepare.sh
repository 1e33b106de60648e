#!/usr/bin/env bash
# On this CPU machine: the wheels the GPU machine lacks (scripts/gpu/kit.txt), for CPython 3.12 manylinux x86_64,
# into .gpu-wheels/ (ignored; carried to the device with the run). Pure-Python packages published only as sources
# are built into py3-none-any wheels here. Usage: scripts/gpu/prepare.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
out=.gpu-wheels
rm -rf "$out" && mkdir -p "$out"
pins=$(python3 scripts/gpu/kit.py pins)
for pin in $pins; do
  if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$out" "$pin" 2>/dev/null; then
    python3 -m pip wheel -q --no-deps -w "$out" "$pin"  # an sdist-only package: pure Python, built here
  fi
done
python3 scripts/gpu/kit.py check "$out"
du -sh "$out"
