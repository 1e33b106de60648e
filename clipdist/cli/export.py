"""`clipdist export`: a trained model as open_clip or transformers loads it (clipdist.tools.export)."""

from __future__ import annotations

import argparse
from pathlib import Path

from clipdist.cli.command import Command, arg


def run(args: argparse.Namespace) -> int:
    from clipdist.tools.export import export

    said = export(
        args.source,
        args.out,
        format=args.format,
        overwrite=args.overwrite,
        pretrained=args.pretrained,
        model_name=args.model,
        ema=args.ema,
        parts=args.parts,
    )
    if args.format == "transformers":
        print(
            f"exported {said} to {args.out}: transformers.CLIPModel.from_pretrained('{args.out}'), "
            f"CLIPProcessor.from_pretrained('{args.out}'), or pipeline('zero-shot-image-classification', "
            f"model='{args.out}')"
        )
    elif (Path(args.out) / "image_tower").is_dir():  # a NaFlex tower (tools.export.IMAGE_TOWER)
        print(
            f"exported {said} to {args.out}: clipdist eval {args.out}, open_clip main's "
            f"create_model_and_transforms('local-dir:{args.out}') (open_clip 3.3 cannot read its timm_model_kwargs), "
            f"or the image tower alone: timm.create_model('local-dir:{args.out}/image_tower', pretrained=True)"
        )
    else:
        print(
            f"exported {said} to {args.out}: open_clip.create_model_and_transforms('local-dir:{args.out}'), "
            f"or clip_benchmark eval --model local-dir:{args.out} --pretrained ''"
        )
    return 0


COMMAND = Command(
    "export",
    help="a trained model as open_clip or Hugging Face transformers loads it, for sharing and downstream use",
    description="Write a model as a folder: in open_clip's hub layout (open_clip_config.json + "
    "open_clip_model.safetensors, a run's checkpoint as it is; open_clip's 'local-dir:<out>', clip_benchmark) "
    "or, with --format transformers, as transformers' CLIPModel + CLIPProcessor (from_pretrained, pipelines).",
    arguments=(
        arg(
            "source",
            help="a run directory or a .pt / .dcp checkpoint; for --format transformers also "
            "an export folder or an open_clip model name (with --pretrained)",
        ),
        arg("--out", required=True, help="output folder"),
        arg(
            "--format",
            choices=["open_clip", "transformers"],
            default="open_clip",
            help="open_clip's hub layout (default) or transformers' CLIPModel",
        ),
        arg("--pretrained", default=None, help="open_clip pretrained tag of a model name (transformers)"),
        arg("--model", default=None, help="the model a bare weights file fits (transformers)"),
        arg("--overwrite", action="store_true", help="replace a non-empty --out folder"),
        arg("--ema", action="store_true", help="a run's weight average (optim.ema) as the weights"),
        arg(
            "--parts",
            action="store_true",
            help="also the modules only a loss term trains (loss.decoder's caption decoder, the teacher terms' heads), "
            "in training_parts.safetensors beside the model (open_clip's layout; left out by default)",
        ),
    ),
    run=run,
)
