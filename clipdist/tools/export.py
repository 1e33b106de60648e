"""`clipdist export`: a trained model as open_clip loads it, with no clipdist installed.

The output is a folder in open_clip's hub layout — `open_clip_config.json` ({"model_cfg", "preprocess_cfg"})
beside `open_clip_model.safetensors` (the weights alone) — which open_clip 3.x opens as
`create_model_and_transforms("local-dir:PATH")`, clip_benchmark as `--model local-dir:PATH`, and which can be
uploaded to a hub as it is. The source is a run directory (its newest checkpoint), a `.dcp` checkpoint folder,
or a `.pt` checkpoint of the days before the one format; all read without running anything in them.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from clipdist.config import model_config
from clipdist.models import (EXPORT_CONFIG, EXPORT_WEIGHTS, built_model_config, create_model, model_overrides,
                             resolve_model_name)
from clipdist.weights import find_checkpoint, read_run_checkpoint


def open_clip_config(model_name: str, weights: dict[str, torch.Tensor], model_settings: dict | None = None) -> dict:
    """open_clip's {"model_cfg", "preprocess_cfg"} for `model_name` (a name or config file clipdist knows) as the
    run built it: its `model` config's overrides (force_*, image_*) applied; a logit bias in the weights (SigLIP)
    goes into model_cfg, so open_clip builds the model with one."""
    name = resolve_model_name(model_name)
    overrides = model_overrides(model_config(model_settings or {}), fetch=False)
    model_cfg = built_model_config(name, overrides)
    if "logit_bias" in weights:
        model_cfg["init_logit_bias"] = float(weights["logit_bias"])
    preprocess = create_model(name, device="meta", overrides=overrides).visual.preprocess_cfg
    return {"model_cfg": model_cfg, "preprocess_cfg": {key: list(value) if isinstance(value, tuple) else value
                                                       for key, value in preprocess.items()}}


def export(source: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write `source`'s model to the folder `out` (see the module docstring); the checkpoint it came from.
    The folder appears whole or not at all (written beside it, then renamed)."""
    checkpoint = find_checkpoint(source)
    weights, config = read_run_checkpoint(checkpoint)
    model_name = config.get("model", {}).get("name")
    if not model_name:
        raise ValueError(f"{checkpoint} does not say which model it holds (no model.name in its config)")
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty; give another --out, or --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config_json = open_clip_config(model_name, weights, config.get("model"))
        (staging / EXPORT_CONFIG).write_text(json.dumps(config_json, indent=2) + "\n")
        save_file({key: value.detach().contiguous() for key, value in weights.items()}, str(staging / EXPORT_WEIGHTS),
                  metadata={"format": "pt", "source": str(checkpoint)})
        umask = os.umask(0)
        os.umask(umask)
        for path in (staging, *staging.iterdir()):  # mkdtemp made them private: as any new file would be
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return checkpoint
