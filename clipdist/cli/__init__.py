"""`clipdist` command line: train, torchrun, gradcheck, plan, bench (loss, gpu, limit), make-shards, export, eval,
trust, report — a module a subcommand, each declaring its arguments and its call as a COMMAND
(clipdist.cli.command); what a command does
lives in clipdist.tools (or the package it names), imported only when it runs, so `clipdist --help` stays quick."""

from __future__ import annotations

import argparse
import sys

from clipdist.cli import bench, evaluate, export, gradcheck, make_shards, plan, report, trust
from clipdist.cli.command import OneLineParser
from clipdist.cli.train import train_main
from clipdist.compat import floor_problem
from clipdist.distributed import host
from clipdist.errors import ClipdistError, is_failure, printable, report_bug, said

__all__ = ["build_parser", "main", "train_main"]
COMMANDS = tuple(module.COMMAND for module in (gradcheck, plan, bench, make_shards, export, evaluate, trust, report))
DESCRIPTION = (
    "CLIP pretraining with exact distributed contrastive losses: train, torchrun, gradcheck, plan, bench (loss, gpu, "
    "limit), make-shards, export, eval, trust, report"
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="clipdist", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "train",
        add_help=False,
        help="train: Hydra overrides follow (clipdist train loss=disco world=cpu2; --help lists groups)",
    )
    commands.add_parser(
        "torchrun",
        add_help=False,
        help="torchrun's launch (its options, then train.py and overrides), a failed rank ending it in one line",
    )
    for command in COMMANDS:
        command.add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    host.spin_briefly()  # before torch loads libgomp
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    problem = floor_problem()
    if problem:
        print(f"clipdist: error: {problem}", file=sys.stderr)
        return 2
    if argv[:1] == ["train"]:
        train_main(argv[1:], program=program)  # `clipdist train ...` as the program: the process ends with it
        return 0
    if argv[:1] == ["torchrun"]:
        from clipdist.distributed import torchrun

        return torchrun.main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or an argument refused in its one line (2)
        return int(done.code or 0)
    try:
        return args.run(args)
    except (ClipdistError, ValueError, OSError) as error:
        print(printable(f"clipdist {args.command}: error: {said(error)}"), file=sys.stderr)
        return 2
    except BaseException as error:  # noqa: BLE001 -- a bug: one line, the traceback in a file
        if not is_failure(error):
            raise
        print(f"clipdist {args.command}: {report_bug(error)}", file=sys.stderr)
        return 1
