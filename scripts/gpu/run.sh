#!/usr/bin/env bash
# On the GPU machine, in one device call: install the kit's wheels beside the site's torch (nothing from a
# registry, torch untouched), put the project on the path, and run the battery within its budget; every finished
# row lands in $OUT (or docs/bench) at once, so a call that runs out of time still brings back what finished.
# The device call (docs/performance.md): command "bash scripts/gpu/run.sh", carry [".gpu-wheels"], timeout_s 480.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-docs/bench}
budget=${BUDGET:-360}  # of a 480 s call: installing the kit and starting took ~60 s on the H200 (2026-11-27)
torch_before=$(python -c "import torch; print(torch.__version__)")
python -m pip install -q --no-deps --no-index .gpu-wheels/*.whl
python -m pip install -q --no-deps --no-index --no-build-isolation . 2>/dev/null \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # no setuptools >= 77 in the image: run from the tree
torch_after=$(python -c "import torch; print(torch.__version__)")
[ "$torch_before" = "$torch_after" ] || { echo "run.sh: torch changed ($torch_before -> $torch_after)" >&2; exit 1; }
python -c "import clipdist, open_clip, webdataset, hydra, torch; print('kit ready: torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'open_clip', open_clip.__version__)"
mkdir -p "$out"
python -m clipdist bench gpu --budget "$budget" --out "$out/gpu_battery.json" --doc "$out/gpu_battery.md" "$@"
