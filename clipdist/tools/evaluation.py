"""`clipdist eval`: a model evaluated on any evaluation sets, without training it.

    clipdist eval runs/my-run --set val=/data/val --set pets=/data/wds_pets [--world 2] [--out metrics.json]

TARGET is a run directory (its newest checkpoint), a `.dcp` / `.pt` checkpoint, an export folder
(`clipdist export`, open_clip's hub layout), or an open_clip model name with `--pretrained TAG` (or `hf-hub:`).
A run's checkpoint is read safely (clipdist.weights) and built as the run built it (its model overrides, its
logit bias). Sets are any spec clipdist reads (shards, clip_benchmark folders) with their class names and
templates beside them, or `--classnames` / `--templates`. With `--world N` the set is split over N local gloo
ranks (clipdist.evaluate): the metrics are the one-process metrics.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from clipdist.launch import COLLECTIVE_TIMEOUT_S


def load_model(target: str, pretrained: str | None = None, model_name: str | None = None,
               cache_dir: str | None = None, device: str = "cpu") -> tuple[torch.nn.Module, str]:
    """(the model TARGET names, the model name its tokenizer goes by); a ValueError in one line where it cannot.
    device="meta": the structure alone, the weights only checked to fit."""
    from clipdist.config import model_config
    from clipdist.models import create_model, model_overrides, weights_for
    from clipdist.tools.export import CONFIG_FILE
    from clipdist.weights import CHECKPOINT, find_checkpoint, read_run_checkpoint

    path = Path(target).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():  # an export (or any open_clip local-dir model)
        name = f"local-dir:{path}"
        return create_model(name, cache_dir=cache_dir, device=device), name
    if path.exists() and (path.is_dir() or CHECKPOINT.search(path.name)):
        checkpoint = find_checkpoint(path)
        weights, config = read_run_checkpoint(checkpoint)
        model_cfg = model_config(config.get("model", {}))
        model = create_model(model_cfg.name, init_logit_bias=0.0 if "logit_bias" in weights else None,
                             overrides=model_overrides(model_cfg, fetch=False), device=device)
        fitting = weights_for(model, weights, checkpoint)
        if device != "meta":
            model.load_state_dict(fitting)
        return model, model_cfg.name
    if path.is_file():  # a weights file: the model it fits must be named
        if not model_name:
            raise ValueError(f"{target} is a weights file: name its model too (--model ViT-B-32)")
        return create_model(model_name, checkpoint=str(path), cache_dir=cache_dir, device=device), model_name
    return create_model(target, pretrained=pretrained, cache_dir=cache_dir, device=device), target


def check_target(target: str, pretrained: str | None, model_name: str | None) -> None:
    """What load_model would refuse, found without reading any tensor (so no parallel op runs in this process
    before it forks the ranks: libgomp is not fork-safe)."""
    from clipdist.models import pretrained_cfg, resolve_model_name
    from clipdist.tools.export import CONFIG_FILE
    from clipdist.weights import CHECKPOINT, find_checkpoint, verify

    path = Path(target).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return
    if path.exists() and (path.is_dir() or CHECKPOINT.search(path.name)):
        verify(find_checkpoint(path))
    elif path.is_file():
        if not model_name:
            raise ValueError(f"{target} is a weights file: name its model too (--model ViT-B-32)")
        resolve_model_name(model_name)
    else:
        pretrained_cfg(resolve_model_name(target), pretrained)


def model_structure(target: str, pretrained: str | None = None) -> torch.nn.Module:
    """The model TARGET names (as load_model takes it) on the meta device: its structure, no tensor read (a run's
    checkpoint is verified and its config read)."""
    from clipdist.config import model_config
    from clipdist.models import create_model, model_overrides
    from clipdist.tools.export import CONFIG_FILE
    from clipdist.weights import CHECKPOINT, find_checkpoint, verify

    path = Path(target).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return create_model(f"local-dir:{path}", device="meta")
    if path.exists() and (path.is_dir() or CHECKPOINT.search(path.name)):  # verified once, its config read
        model_cfg = model_config(verify(find_checkpoint(path)).get("config", {}).get("model", {}))
        return create_model(model_cfg.name, overrides=model_overrides(model_cfg, fetch=False), device="meta")
    check_target(target, pretrained, None)  # a name and its pretrained tag (a bare weights file names no model)
    return create_model(target, device="meta")


def eval_sets(sets: dict[str, str], classnames: list[str], templates: list[str]):
    """EvalSets from name -> spec; class names and templates beside a set's shards win over the given ones."""
    from clipdist.data.sources import DEFAULT_TEMPLATES, eval_set

    if not sets:
        raise ValueError("no evaluation set: give one or more, --set NAME=SPEC (shards, a folder, clip_benchmark's)")
    return [eval_set(name, spec, list(classnames), list(templates) or DEFAULT_TEMPLATES, key=f"--set {name}")
            for name, spec in sets.items()]


def _evaluate_here(target, pretrained, model_name, cache_dir, evalsets, batch_size, precision) -> dict:
    """Every set on this rank (every rank calls it under launch_local: each encodes its share)."""
    from clipdist import precision as precisions
    from clipdist.config import DataConfig
    from clipdist.evaluate import evaluate
    from clipdist.models import get_tokenizer
    from clipdist.trainer import image_transforms

    from clipdist.host import intra_op_threads
    from clipdist.parallel import rank_and_world_size

    torch.set_num_threads(intra_op_threads(None, rank_and_world_size()[1])[0])  # the CPUs shared by the ranks
    device = torch.device("cpu")
    model, name = load_model(target, pretrained, model_name, cache_dir)
    model = model.to(device, precisions.weights_dtype(precision))
    _, transform = image_transforms(model.visual.preprocess_cfg, DataConfig())
    tokenizer = get_tokenizer(name, cache_dir)
    metrics = {}
    for evalset in evalsets:
        metrics.update(evaluate(model, tokenizer, evalset, transform, device, max_skips_in_a_row=1000,
                                batch_size=batch_size, autocast=precisions.autocast(precision, device)))
    return metrics


def run_eval(target: str, sets: dict[str, str], *, pretrained: str | None = None, model_name: str | None = None,
             classnames: list[str] = (), templates: list[str] = (), world_size: int = 1, batch_size: int = 256,
             precision: str = "fp32", cache_dir: str | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dict:
    """The metrics of TARGET on `sets` (the module docstring), on one process or `world_size` local ranks."""
    from clipdist.launch import launch_local

    evalsets = eval_sets(sets, list(classnames), list(templates))
    arguments = (target, pretrained, model_name, cache_dir, evalsets, batch_size, precision)
    if world_size == 1:
        return _evaluate_here(*arguments)
    check_target(target, pretrained, model_name)  # a bad target: one line, before the ranks
    return launch_local(_evaluate_here, world_size, *arguments, timeout_s=timeout_s)[0]


def write_metrics(metrics: dict, out: str | Path) -> None:
    Path(out).expanduser().write_text(json.dumps(metrics, indent=2) + "\n")
