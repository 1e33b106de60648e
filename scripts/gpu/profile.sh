#!/usr/bin/env bash
# On the GPU machine, in one device call: install the kit (install.sh), then profile_step.py's cases (all, or those
# named) into $OUT: a JSON of the timings, a kernel table per case, a chrome trace of the B/16 step.
# The device call: command "bash scripts/gpu/profile.sh [case ...]", carry [".gpu-wheels"], timeout_s 480.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-profile_out}
. scripts/gpu/install.sh
mkdir -p "$out"
PYTHONUNBUFFERED=1 python scripts/gpu/profile_step.py --out "$out" --budget "${BUDGET:-330}" "$@"
