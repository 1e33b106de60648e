"""`clipdist make-shards`: an image folder or a table of (path, caption) as WebDataset shards
(clipdist.data.shard_writer)."""

from __future__ import annotations

import argparse
import sys

from clipdist.defaults import TABLE_CAPTION_KEY, TABLE_IMAGE_KEY, TABLE_SEPARATOR


def add(commands) -> None:
    shards = commands.add_parser(
        "make-shards",
        help="write an image folder or a CSV of (path, caption) as WebDataset shards",
        description="Write image/caption pairs as WebDataset shards in the img2dataset layout "
        "(.jpg/.png + .txt + .json).",
    )
    source = shards.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--images", help="folder of images; caption from a same-name .txt, else the parent folder's name"
    )
    source.add_argument(
        "--csv", help="a table of image paths (relative to it) and captions; by default open_clip's TSV layout"
    )
    shards.add_argument(
        "--separator", default=TABLE_SEPARATOR, help="--csv's column separator: \\t / tab (default, open_clip's) or ,"
    )
    shards.add_argument("--path-column", default=TABLE_IMAGE_KEY, help="default: filepath (open_clip's)")
    shards.add_argument("--caption-column", default=TABLE_CAPTION_KEY, help="default: title (open_clip's)")
    shards.add_argument("--out", required=True, help="output folder")
    shards.add_argument("--prefix", default="shard")
    shards.add_argument("--samples-per-shard", type=int, default=1000)
    shards.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out folder (as a whole, once the new shards are written)",
    )
    shards.set_defaults(run=run)


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
