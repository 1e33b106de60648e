"""`clipdist eval`: a model evaluated on any evaluation sets, without training it.

    clipdist eval runs/my-run --set val=/data/val --set pets=/data/wds_pets [--world 2] [--out metrics.json]

TARGET is a run directory (its newest checkpoint), a `.dcp` / `.pt` checkpoint, an export folder
(`clipdist export`, open_clip's hub layout), or an open_clip model name with `--pretrained TAG` (or `hf-hub:`).
A run's checkpoint is read safely (clipdist.checkpoint.weights) and built as the run built it (its model overrides, its
logit bias). Sets are any spec clipdist reads (shards, clip_benchmark folders) with their class names and
templates beside them, or `--classnames` / `--templates`. With `--world N` the set is split over N local gloo
ranks (clipdist.train.evaluate): the metrics are the one-process metrics.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from clipdist.config import DataConfig
from clipdist.data.sources import DEFAULT_TEMPLATES, eval_set
from clipdist.data.transforms import image_transforms
from clipdist.defaults import COLLECTIVE_TIMEOUT_S
from clipdist.distributed.host import intra_op_threads
from clipdist.distributed.launch import launch_local
from clipdist.distributed.parallel import rank_and_world_size
from clipdist.files import write_atomic
from clipdist.model import precision as precisions
from clipdist.model import targets
from clipdist.model.factory import get_tokenizer
from clipdist.tools.dense_probe import dense_probe
from clipdist.train.evaluate import evaluate


def eval_sets(sets: dict[str, str], classnames: list[str], templates: list[str], dense: bool = False):
    """EvalSets from name -> spec; class names and templates beside a set's shards win over the given ones."""
    if not sets and not dense:
        raise ValueError(
            "no evaluation set: give one or more, --set NAME=SPEC (shards, a folder, clip_benchmark's), or --dense"
        )
    return [
        eval_set(name, spec, list(classnames), list(templates) or DEFAULT_TEMPLATES, key=f"--set {name}")
        for name, spec in sets.items()
    ]


def _evaluate_here(
    target,
    pretrained,
    model_name,
    cache_dir,
    evalsets,
    batch_size,
    precision,
    retrieval_ties="pessimistic",
    ema=False,
    dense=False,
) -> dict:
    """Every set on this rank (every rank calls it under launch_local: each encodes its share)."""
    torch.set_num_threads(intra_op_threads(None, rank_and_world_size()[1])[0])  # the CPUs shared by the ranks
    device = torch.device("cpu")
    model, name = targets.load(targets.resolve(target, pretrained, model_name, ema), cache_dir)
    model = model.to(device, precisions.weights_dtype(precision))
    _, transform = image_transforms(model, DataConfig())
    tokenizer = get_tokenizer(name, cache_dir, getattr(model, "context_length", None))  # a forced length too
    metrics = {}
    for evalset in evalsets:
        metrics.update(
            evaluate(
                model,
                tokenizer,
                evalset,
                transform,
                device,
                max_skips_in_a_row=1000,
                batch_size=batch_size,
                autocast=precisions.autocast(precision, device),
                retrieval_ties=retrieval_ties,
            )
        )
    if dense and rank_and_world_size()[0] == 0:
        metrics.update(dense_probe(model, batch_size=min(batch_size, 64)))
    return metrics


def run_eval(
    target: str,
    sets: dict[str, str],
    *,
    pretrained: str | None = None,
    model_name: str | None = None,
    classnames: Sequence[str] = (),
    templates: Sequence[str] = (),
    world_size: int = 1,
    batch_size: int = 256,
    precision: str = "fp32",
    cache_dir: str | None = None,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    retrieval_ties: str = "pessimistic",
    ema: bool = False,
    dense: bool = False,
) -> dict:
    """The metrics of TARGET on `sets` (the module docstring), on one process or `world_size` local ranks; `ema`:
    a run's or checkpoint's weight average (optim.ema) in place of its weights; `dense`: with the built-in dense
    probe's (tools.dense_probe, on rank 0)."""
    evalsets = eval_sets(sets, list(classnames), list(templates), dense)
    arguments = (target, pretrained, model_name, cache_dir, evalsets, batch_size, precision, retrieval_ties, ema, dense)
    if world_size == 1:
        return _evaluate_here(*arguments)
    targets.check(targets.resolve(target, pretrained, model_name, ema))  # a bad target: one line, before the ranks
    return launch_local(_evaluate_here, world_size, *arguments, timeout_s=timeout_s)[0]


def write_metrics(metrics: dict, out: str | Path) -> None:
    write_atomic(Path(out).expanduser(), json.dumps(metrics, indent=2) + "\n")
