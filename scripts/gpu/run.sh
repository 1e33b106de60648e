#!/usr/bin/env bash
# On the GPU machine, in one device call: install the kit (install.sh) and run the battery within its budget; every
# finished row lands in $OUT (or docs/bench) at once, so a call that runs out of time still brings back what finished.
# The device call (docs/performance.md): command "bash scripts/gpu/run.sh", carry [".gpu-wheels"], timeout_s 480.
# Arguments go to the battery: "--sections step,data,checkpoint,compile,fsdp" fits every row the chip's limit is
# judged by (compiled B/16, FSDP2 at world 1, L/14 compiled, a background save, the real run) in one call; a second
# call with "--resume $OUT/gpu_battery.json" (the first call's rows, fetched back and carried) runs the rest.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-docs/bench}
budget=${BUDGET:-360}  # of a 480 s call: installing the kit and starting took ~60 s on the H200 (2026-11-27)
. scripts/gpu/install.sh
mkdir -p "$out"
python -m clipdist bench gpu --budget "$budget" --out "$out/gpu_battery.json" --doc "$out/gpu_battery.md" "$@"
