"""`clipdist` command line: gradcheck, make-shards, ..."""
from __future__ import annotations

import argparse
import json
import sys


def _batch_sizes(text: str) -> int | list[int]:
    sizes = [int(part) for part in text.split(",")]
    return sizes[0] if len(sizes) == 1 else sizes


def _gradcheck(args: argparse.Namespace) -> int:
    from clipdist.gradcheck import run_gradcheck

    report = run_gradcheck(
        loss=args.loss or args.backend,
        world_size=args.world,
        local_batch=args.batch,
        dtype=args.dtype,
        model=args.model,
        seed=args.seed,
        timeout_s=args.timeout,
        chunks=args.chunks,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _print_report(report, verbose=args.verbose)
    return 0 if report.exact else 1


def _print_report(report, verbose: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from clipdist.gradcheck import SCALAR_PARAMETERS

    console = Console()
    cached = f", grad cache ×{report.chunks}" if report.chunks > 1 else ""
    table = Table(title=f"gradcheck: {report.backend}, world size {report.world_size}, {report.dtype}{cached}")
    table.add_column("parameter")
    table.add_column("rel. error", justify="right")
    table.add_column("verdict")
    table.add_row("loss value", f"{report.loss_rel_err:.2e}", "exact" if report.loss_rel_err <= report.tolerance else "wrong")
    failing = [c for c in report.parameters if c.verdict != "exact"]
    always = [c for c in report.parameters if c.name in SCALAR_PARAMETERS]
    shown = report.parameters if verbose else (failing[:40] + [c for c in always if c not in failing])
    for check in shown:
        style = "green" if check.verdict == "exact" else "red"
        table.add_row(check.name, f"{check.rel_err:.2e}", f"[{style}]{check.verdict}[/{style}]")
    rest = [c for c in report.parameters if c not in shown]
    if rest:
        worst = max(c.rel_err for c in rest)
        verdicts = ", ".join(sorted({c.verdict for c in rest}))
        table.add_row(f"{len(rest)} more parameters (--verbose lists them)", f"≤ {worst:.2e}", verdicts)
    console.print(table)
    for note in report.diagnosis:
        console.print(f"[yellow]•[/yellow] {escape(note)}")
    verdict = "[green]EXACT[/green]" if report.exact else "[red]NOT EXACT[/red]"
    console.print(
        f"{verdict}: {report.backend} on {report.world_size} ranks, max relative error "
        f"{report.max_rel_err:.2e} (tolerance {report.tolerance:.0e}), "
        f"{len(report.parameters) - len(failing)}/{len(report.parameters)} parameters exact"
    )


def _make_shards(args: argparse.Namespace) -> int:
    from clipdist.data.shards import pairs_from_csv, pairs_from_folder, write_shards

    pairs = pairs_from_folder(args.images) if args.images else pairs_from_csv(args.csv, args.path_column, args.caption_column)
    written = write_shards(pairs, args.out, args.prefix, args.samples_per_shard)
    print(f"wrote {len(written)} shard(s) to {args.out}: "
          f"{args.out}/{args.prefix}-{{000000..{len(written) - 1:06d}}}.tar")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clipdist", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "gradcheck",
        help="prove a distributed loss exact against one process on the global batch",
        description="Spawn N local gloo ranks, run one DDP step of a tiny two-tower model with the loss, and "
        "compare the loss and every parameter's gradient with one process on the whole batch.",
    )
    check.add_argument("--backend", default="disco", help="registered backend (naive, gather_layer, disco, tiled, siglip)")
    check.add_argument("--loss", help="your own loss instead: 'package.module:name', same call signature")
    check.add_argument("--world", type=int, default=2, help="number of local ranks (default 2)")
    check.add_argument("--batch", type=_batch_sizes, default=4, help="local batch per rank, or one per rank: 4,3,5")
    check.add_argument("--chunks", type=int, default=1, help="gradient caching: split each rank's batch into K chunks")
    check.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    check.add_argument("--model", default="clipdist-tiny", help="open_clip model config (random init)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--timeout", type=float, default=300, help="seconds before a stuck collective fails")
    check.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    check.add_argument("--verbose", action="store_true", help="list every parameter")
    check.set_defaults(run=_gradcheck)

    shards = commands.add_parser(
        "make-shards",
        help="write an image folder or a CSV of (path, caption) as WebDataset shards",
        description="Write image/caption pairs as WebDataset shards in the img2dataset layout (.jpg/.png + .txt + .json).",
    )
    source = shards.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", help="folder of images; caption from a same-name .txt, else the parent folder's name")
    source.add_argument("--csv", help="CSV with image paths (relative to the CSV) and captions")
    shards.add_argument("--path-column", default="path")
    shards.add_argument("--caption-column", default="caption")
    shards.add_argument("--out", required=True, help="output folder")
    shards.add_argument("--prefix", default="shard")
    shards.add_argument("--samples-per-shard", type=int, default=1000)
    shards.set_defaults(run=_make_shards)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"clipdist {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
