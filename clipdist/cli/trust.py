"""`clipdist trust`: a checkpoint you trust, converted into a copy clipdist reads without running code
(clipdist.tools.trust)."""

from __future__ import annotations

import argparse

from clipdist.cli.command import Command, arg


def run(args: argparse.Namespace) -> int:
    from clipdist.tools.trust import trust

    out = trust(args.source, args.out)
    print(
        f"converted {args.source} to {out}: tensors and plain values only, read without running anything "
        f"(model.checkpoint={out}, resume={out}, clipdist export {out})"
    )
    return 0


COMMAND = Command(
    "trust",
    help="convert a checkpoint or weights file you trust into a copy clipdist reads without running code",
    description="Read SOURCE the unsafe way -- any code it carries RUNS NOW, as you: only for files whose origin "
    "you trust -- and write a copy of its tensors and plain values, which clipdist then reads safely. "
    "See docs/checkpoints.md.",
    arguments=(
        arg("source", help="a .pt/.bin/.pth file or a .dcp checkpoint folder that clipdist refused"),
        arg(
            "--out",
            default=None,
            help="where the copy goes (default: beside it, <stem>.trusted<suffix> / <name>.trusted.dcp)",
        ),
    ),
    run=run,
)
