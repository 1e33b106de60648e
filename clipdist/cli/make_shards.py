"""`clipdist make-shards`: an image folder or a table of (path, caption) as WebDataset shards
(clipdist.data.shard_writer)."""

from __future__ import annotations

import argparse
import sys

from clipdist.cli.arguments import count
from clipdist.cli.command import Command, arg
from clipdist.defaults import TABLE_CAPTION_KEY, TABLE_IMAGE_KEY, TABLE_SEPARATOR


def run(args: argparse.Namespace) -> int:
    from clipdist.data.shard_writer import make_shards, pairs_from_csv, pairs_from_folder

    pairs = (
        pairs_from_folder(args.images)
        if args.images
        else pairs_from_csv(args.csv, args.path_column, args.caption_column, args.separator)
    )
    unreadable = []

    def skip(message: str) -> None:
        unreadable.append(message)
        print(f"warning: skipped {message}", file=sys.stderr)

    written = make_shards(
        pairs, args.out, args.prefix, args.samples_per_shard, overwrite=args.overwrite, on_unreadable=skip
    )
    print(
        f"wrote {len(written)} shard(s) to {args.out}: "
        f"{args.out}/{args.prefix}-{{000000..{len(written) - 1:06d}}}.tar"
        + (f" ({len(unreadable)} unreadable image(s) left out)" if unreadable else "")
    )
    return 0


COMMAND = Command(
    "make-shards",
    help="write an image folder or a CSV of (path, caption) as WebDataset shards",
    description="Write image/caption pairs as WebDataset shards in the img2dataset layout (.jpg/.png + .txt + .json).",
    one_of=(
        arg("--images", help="folder of images; caption from a same-name .txt, else the parent folder's name"),
        arg("--csv", help="a table of image paths (relative to it) and captions; by default open_clip's TSV layout"),
    ),
    arguments=(
        arg(
            "--separator",
            default=TABLE_SEPARATOR,
            help="--csv's column separator: \\t / tab (default, open_clip's) or ,",
        ),
        arg("--path-column", default=TABLE_IMAGE_KEY, help="default: filepath (open_clip's)"),
        arg("--caption-column", default=TABLE_CAPTION_KEY, help="default: title (open_clip's)"),
        arg("--out", required=True, help="output folder"),
        arg("--prefix", default="shard"),
        arg("--samples-per-shard", type=count, default=1000),
        arg(
            "--overwrite",
            action="store_true",
            help="replace a non-empty --out folder (as a whole, once the new shards are written)",
        ),
    ),
    run=run,
)
