#!/usr/bin/env bash
# Try the newest releases of every dependency (torch kept at requirements/ci.txt's, which installs from local disk;
# other torch releases download several GB) in a fresh venv, run the suite, and say what moved and what broke.
# Usage: scripts/check_newest.sh [pytest args...]   (default: the whole suite, as CI runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
torch_pins=$(grep -E '^(torch|torchvision|torchcodec)==' requirements/ci.txt)  # torchcodec: built for one torch
# shellcheck disable=SC2086
python -m pip install -q --upgrade -e ".[test]" $torch_pins
echo "== releases newer than requirements/ci.txt:"
python - <<'PY'
import re
from importlib import metadata
pinned = dict(re.match(r"([^=]+)==(.+)", line).groups() for line in open("requirements/ci.txt")
              if re.match(r"[^#\s].*==", line))
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
pinned = {norm(name): version for name, version in pinned.items()}
moved = [(d.metadata["Name"], pinned.get(norm(d.metadata["Name"])), d.version) for d in metadata.distributions()
         if norm(d.metadata["Name"]) in pinned and pinned[norm(d.metadata["Name"])] != d.version]
for name, old, new in sorted(moved):
    print(f"  {name}: {old} -> {new}")
print(f"  ({len(moved)} moved)")
PY
newest=$(python -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
tested=$(sed -n 's/^transformers==//p' requirements/transformers-newest.txt)
echo "== transformers, the top of the transformers extra: newest ${newest:-unknown}, tested ${tested}"
[ -n "$newest" ] && [ "$newest" != "$tested" ] && echo "   bump requirements/transformers-newest.txt (and its deps) and rerun tests/integration/test_transformers_export.py"
status=0
python -m pytest -q -n 2 --dist loadfile "$@" || status=$?
if [ "$status" -eq 0 ]; then
  echo "== the suite passes on the newest releases: refresh requirements/ci.txt with"
  echo "   pip freeze --exclude-editable (keep its header)"
else
  echo "== the suite fails on the newest releases (above): the failing tests and the moved packages say what broke"
fi
exit "$status"
