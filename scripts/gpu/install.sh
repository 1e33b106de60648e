#!/usr/bin/env bash
# Sourced by the device scripts (run.sh, profile.sh): install the kit's wheels beside the site's torch (nothing from a
# registry, torch untouched) and put the project on the path.
torch_before=$(python -c "import torch; print(torch.__version__)")
python -m pip install -q --no-deps --no-index .gpu-wheels/*.whl
python -m pip install -q --no-deps --no-index --no-build-isolation . 2>/dev/null \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # no setuptools >= 77 in the image: run from the tree
torch_after=$(python -c "import torch; print(torch.__version__)")
[ "$torch_before" = "$torch_after" ] || { echo "install.sh: torch changed ($torch_before -> $torch_after)" >&2; exit 1; }
python -c "import clipdist, open_clip, webdataset, hydra, torch; print('kit ready: torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'open_clip', open_clip.__version__)"
