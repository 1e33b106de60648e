"""`clipdist eval`: a run, checkpoint, export or open_clip model on evaluation sets, without training
(clipdist.tools.evaluation)."""

from __future__ import annotations

import argparse
import json

from clipdist.cli.arguments import count, csv
from clipdist.cli.command import Command, arg


def _named_set(text: str) -> tuple[str, str]:
    name, separator, spec = text.partition("=")
    if not separator or not name or not spec:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=SPEC, e.g. --set val=/data/val")
    return name, spec


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from clipdist.files import check_output, is_json
    from clipdist.tools.evaluation import run_eval, write_metrics

    names = [name for name, _ in args.sets or []]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:  # a dict kept the last of them without a word
        raise ValueError(f"--set {twice}=... given {names.count(twice)} times: name each set once")
    if args.out:
        check_output(args.out, "--out", is_json)
    metrics = run_eval(
        args.target,
        dict(args.sets or []),
        pretrained=args.pretrained,
        model_name=args.model,
        classnames=args.classnames or [],
        templates=args.templates or [],
        world_size=args.world,
        batch_size=args.batch,
        precision=args.precision,
        cache_dir=args.cache_dir,
        retrieval_ties=args.retrieval_ties,
        ema=args.ema,
        dense=args.dense,
    )
    if args.out:
        write_metrics(metrics, args.out)
    if args.json:
        print(json.dumps(metrics, indent=2))
        return 0
    table = Table(title=f"clipdist eval: {args.target}" + (f" ({args.world} ranks)" if args.world > 1 else ""))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    if args.out:
        print(f"written to {args.out}")
    return 0


COMMAND = Command(
    "eval",
    help="evaluate a run, checkpoint, export or open_clip model on evaluation sets, without training",
    description="Zero-shot top-1/top-5, retrieval recall@k, mean/median rank and the CLIP validation loss of a "
    "model on one or more evaluation sets; on one process or split over N local ranks (the same metrics).",
    arguments=(
        arg(
            "target",
            help="a run directory, a .dcp/.pt checkpoint, an export folder, or an open_clip "
            "model name (with --pretrained) or hf-hub:ORG/REPO",
        ),
        arg(
            "--set",
            dest="sets",
            action="append",
            type=_named_set,
            metavar="NAME=SPEC",
            help="an evaluation set: shards, a folder, a clip_benchmark dataset folder (repeatable)",
        ),
        arg(
            "--dense",
            action="store_true",
            help="also a linear probe on the image tower's patch tokens over generated scenes of shapes (a label per "
            "pixel): dense/miou and dense/patch_accuracy (docs/training.md)",
        ),
        arg("--pretrained", default=None, help="open_clip pretrained tag of a model name"),
        arg("--model", default=None, help="the model a bare weights file fits (ViT-B-32)"),
        arg(
            "--classnames",
            type=csv(str),
            default=None,
            help="comma-separated class names, where no classnames.txt is beside the set",
        ),
        arg(
            "--templates",
            action="append",
            default=None,
            help="a zero-shot prompt with {} (repeatable; default 'a photo of {}.')",
        ),
        arg("--world", type=count, default=1, help="local gloo ranks to split the sets over"),
        arg("--batch", type=count, default=256, help="images per forward"),
        arg("--precision", choices=["fp32", "bf16", "fp16", "pure_bf16", "pure_fp16"], default="fp32"),
        arg("--cache-dir", default=None, help="where downloaded weights go (Hugging Face's cache)"),
        arg(
            "--retrieval-ties",
            choices=["pessimistic", "open_clip"],
            default="pessimistic",
            help="repeated captions: a tie counts against the image (default), or open_clip_train's argsort order",
        ),
        arg("--ema", action="store_true", help="a run's weight average (optim.ema) as the weights"),
        arg("--out", default=None, help="write the metrics to this JSON file"),
        arg("--json", action="store_true", help="print the metrics as JSON"),
    ),
    run=run,
)
