"""`clipdist export`: a trained model as open_clip loads it, with no clipdist installed (or, with
`--format transformers`, as Hugging Face transformers does: clipdist.tools.to_transformers).

The output is a folder in open_clip's hub layout — `open_clip_config.json` ({"model_cfg", "preprocess_cfg"})
beside `open_clip_model.safetensors` (the weights alone) — which open_clip 3.x opens as
`create_model_and_transforms("local-dir:PATH")`, clip_benchmark as `--model local-dir:PATH`, and which can be
uploaded to a hub as it is. The source is a run directory (its newest checkpoint), a `.dcp` checkpoint folder,
or a `.pt` checkpoint of the days before the one format; all read without running anything in them. The modules
only a loss term trains (the caption decoder, the teacher terms' heads) are left out; `--parts` writes them beside the
model, keys as on the training model, in `training_parts.safetensors`.

A NaFlex image tower's config carries `vision_cfg.timm_model_kwargs` (open_clip main reads it; open_clip 3.3 does
not, clipdist does), and the tower is written a second time as timm's own folder, `image_tower/` (timm.save_for_hf:
config.json with its architecture and arguments, model.safetensors): `timm.create_model("local-dir:…/image_tower",
pretrained=True)` loads it alone.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from timm.models import save_for_hf

from clipdist.checkpoint.weights import find_checkpoint, read_run_checkpoint
from clipdist.config import model_config
from clipdist.files import publish, save_safetensors, write_atomic
from clipdist.model import targets
from clipdist.model.factory import (
    EXPORT_CONFIG,
    EXPORT_WEIGHTS,
    built_model_config,
    create_model,
    get_tokenizer,
    hub_offline,
    model_overrides,
    resolve_model_name,
)
from clipdist.model.timm_towers import KWARGS_KEY, naflex_trunk
from clipdist.registry.terms import training_only
from clipdist.tools import to_transformers


def open_clip_config(model_name: str, weights: dict[str, torch.Tensor], model_settings: dict | None = None) -> dict:
    """open_clip's {"model_cfg", "preprocess_cfg"} for `model_name` (a name or config file clipdist knows) as the
    run built it: its `model` config's overrides (force_*, image_*) applied; a logit bias in the weights (SigLIP)
    goes into model_cfg, so open_clip builds the model with one."""
    name = resolve_model_name(model_name)
    overrides = model_overrides(model_config(model_settings or {}), fetch=False)
    model_cfg = built_model_config(name, overrides)
    if "logit_bias" in weights:
        model_cfg["init_logit_bias"] = float(weights["logit_bias"])
    model: Any = create_model(name, device="meta", overrides=overrides)  # open_clip's CLIP: its visual tower's config
    preprocess: dict = model.visual.preprocess_cfg
    return {
        "model_cfg": model_cfg,
        "preprocess_cfg": {
            key: list(value) if isinstance(value, tuple) else value for key, value in preprocess.items()
        },
    }


TRAINING_PARTS = "training_parts.safetensors"  # --parts: the modules only a loss term trains, beside the model


def _write_open_clip(checkpoint: Path, folder: Path, ema: bool = False, parts: bool = False) -> None:
    weights, config = read_run_checkpoint(checkpoint, ema=ema, training_parts=parts)
    own = {name: weights.pop(name) for name in [name for name in weights if training_only(name)]}
    if parts and not own:
        raise ValueError(
            f"{checkpoint} holds no module of a loss term's own (loss.decoder, loss.self_distill, loss.masked): "
            "leave out --parts"
        )
    model_name = config.get("model", {}).get("name")
    if not model_name:
        raise ValueError(f"{checkpoint} does not say which model it holds (no model.name in its config)")
    targets.saved_name(model_name, str(checkpoint))  # a saved hub name: from the cache only
    with hub_offline():
        config_json = open_clip_config(model_name, weights, config.get("model"))
    folder.mkdir()
    write_atomic(folder / EXPORT_CONFIG, json.dumps(config_json, indent=2) + "\n")
    save_safetensors(
        {key: value.detach().contiguous() for key, value in weights.items()},
        folder / EXPORT_WEIGHTS,
        metadata={"format": "pt", "source": str(checkpoint)},
    )
    if own:  # keys as on the training model (caption_decoder.*, self_distill_head.*, ...)
        save_safetensors(
            {key: value.detach().contiguous() for key, value in own.items()},
            folder / TRAINING_PARTS,
            metadata={"format": "pt", "source": str(checkpoint)},
        )
    if KWARGS_KEY in config_json["model_cfg"]["vision_cfg"] or "naflexvit" in str(
        config_json["model_cfg"]["vision_cfg"].get("timm_model_name")
    ):
        _write_image_tower(folder, config_json["preprocess_cfg"])


IMAGE_TOWER = "image_tower"  # a NaFlex export's timm folder


def _write_image_tower(folder: Path, preprocess: dict) -> None:
    """The export's NaFlex image tower as timm's own folder (IMAGE_TOWER), with the export's mean, std and
    interpolation as its data config."""
    model = create_model(f"local-dir:{folder}")
    trunk = naflex_trunk(model)
    if trunk is None:
        return
    data_config = {key: preprocess[key] for key in ("mean", "std", "interpolation") if key in preprocess}
    save_for_hf(trunk, str(folder / IMAGE_TOWER), safe_serialization=True, data_config=data_config)


def export(
    source: str | Path,
    out: str | Path,
    *,
    format: str = "open_clip",
    overwrite: bool = False,
    pretrained: str | None = None,
    model_name: str | None = None,
    cache_dir: str | None = None,
    ema: bool = False,
    parts: bool = False,
) -> str:
    """Write `source`'s model to the folder `out` in `format` ("open_clip": the module docstring; "transformers":
    clipdist.tools.to_transformers); what it came from, said for the console. The folder appears whole or not at
    all (written beside it, then renamed). open_clip's layout copies a run's checkpoint as it is; transformers'
    converts any model clipdist eval takes (a run, a checkpoint, an export, an open_clip name). `parts`: also the
    modules only a loss term trains, in TRAINING_PARTS beside the model (open_clip's layout only)."""
    if format == "open_clip":
        checkpoint = find_checkpoint(source)
        publish(out, lambda folder: _write_open_clip(checkpoint, folder, ema, parts), overwrite=overwrite)
        return f"{checkpoint}'s weight average" if ema else str(checkpoint)
    if parts:
        raise ValueError("--parts writes open_clip's layout only (transformers' CLIPModel has no place for them)")
    if format != to_transformers.FORMAT:
        raise ValueError(f"unknown export format {format!r}; choose open_clip or transformers")
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("--format transformers needs Hugging Face transformers: pip install 'clipdist[transformers]'")
    target = targets.resolve(str(source), pretrained, model_name, ema)
    if target.kind == "name" and not target.pretrained and not target.spec.startswith(("hf-hub:", "local-dir:")):
        raise ValueError(
            f"{target.spec} names a model, not weights: it would export random weights. Add --pretrained TAG "
            "(open_clip.list_pretrained_tags_by_model), or export a run, a checkpoint or an export folder"
        )
    targets.check(target)
    model, name = targets.load(target, cache_dir)
    tokenizer = get_tokenizer(name, cache_dir, getattr(model, "context_length", None))
    difference = []
    publish(
        out,
        lambda folder: difference.append(to_transformers.write_transformers(model, tokenizer, folder)),
        overwrite=overwrite,
    )
    has_bias = getattr(model, "logit_bias", None) is not None
    bias = " (its logit bias in config.json: CLIPModel has none)" if has_bias else ""
    return f"{target.path or target.spec} as transformers' CLIPModel{bias}, features within {difference[0]:.1e}"
