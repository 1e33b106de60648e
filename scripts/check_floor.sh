#!/usr/bin/env bash
# Prove clipdist beside a site's own torch: a fresh venv gets TORCH and TORCHVISION first (a cluster image's, or the
# floor pyproject.toml declares), then clipdist installed the way README.md says (constraints that hold the
# installed torch and torchvision), then: the two left in place, the unit tests, and the default run.
# Usage: scripts/check_floor.sh [torch version] [torchvision version]   (default: the floor, 2.6.0 / 0.21.0)
# Downloads torch from the package index (several GB with its CUDA libraries): not part of CI; run it on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${1:-2.6.0}
vision_version=${2:-0.21.0}
work=${CHECK_FLOOR_DIR:-$(mktemp -d)}
venv=$work/venv
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
echo "== the site's torch: torch==$torch_version torchvision==$vision_version"
python -m pip install -q "torch==$torch_version" "torchvision==$vision_version"
# README's install beside the site's torch: the installed torch and torchvision as constraints
python -m pip install -q -e ".[test]" -c <(python -c 'import torch; v = torch.__version__.split("+")[0]; m = int(v.split(".")[1]) + 15; print(f"torch=={v}\ntorchvision==0.{m}.*")')
echo "== after installing clipdist:"
python - "$torch_version" "$vision_version" <<'PY'
import sys
import torch, torchvision
print(f"   torch {torch.__version__}, torchvision {torchvision.__version__}")
assert torch.__version__.split("+")[0] == sys.argv[1], "torch was replaced"
assert torchvision.__version__.split("+")[0] == sys.argv[2], "torchvision was replaced"
PY
echo "== the unit tests"
python -m pytest -q -n 2 -p no:cacheprovider tests/unit
echo "== the default run"
run_dir=$work/run
python train.py run_dir="$run_dir" logging.report=false
python - "$run_dir" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/train_log.jsonl")]
print(f"   {len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
assert rows[-1]["loss"] < rows[0]["loss"], "the default run did not learn"
PY
echo "== torch $torch_version / torchvision $vision_version: kept, unit tests and the default run pass"
