"""The one way a subcommand is declared: its name, help, arguments and the function it runs, as data.

    COMMAND = Command("report", help="a run at a glance", arguments=(arg("run_dir", metavar="RUN"),), run=run)

`clipdist/cli/__init__.py` adds every module's COMMAND to the parser; `run(args)` gets the parsed arguments
(with `given_only`, only those the user gave: the called function's own defaults apply to the rest, so no
default is written twice — `given(args)`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

Argument = tuple[tuple[str, ...], dict[str, Any]]


class OneLineParser(argparse.ArgumentParser):
    """argparse, its refusals one line as every clipdist error is (`clipdist plan: error: argument --global-batch: 0:
    must be at least 1`), exit 2; `--help` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def arg(*flags: str, **options: Any) -> Argument:
    """One argument, as argparse's add_argument takes it; a number's type must be a bounded one
    (clipdist.cli.arguments.number): a bare int or float would take 0 steps or -3 ranks on to the work."""
    if options.get("type") in (int, float):
        raise TypeError(
            f"{flags[0]}: type={options['type'].__name__} takes any number; use a clipdist.cli.arguments type"
        )
    return flags, options


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int] | None = None  # None: it has subcommands
    arguments: tuple[Argument, ...] = ()
    description: str | None = None  # `clipdist <name> --help`'s paragraph; default its help
    subcommands: tuple[Command, ...] = ()  # `clipdist bench loss|gpu|limit`: chosen as args.kind
    given_only: bool = False  # an option the user did not give is absent from args (argparse.SUPPRESS)
    one_of: tuple[Argument, ...] = ()  # arguments of which exactly one must be given

    def add(self, commands) -> None:
        """This command (and its subcommands) on `commands`, an argparse subparsers action."""
        parser = commands.add_parser(self.name, help=self.help, description=self.description or self.help)
        if self.given_only:
            parser.argument_default = argparse.SUPPRESS
        for flags, options in self.arguments:
            parser.add_argument(*flags, **options)
        exclusive = parser.add_mutually_exclusive_group(required=True) if self.one_of else None
        for flags, options in self.one_of:
            exclusive.add_argument(*flags, **options)  # type: ignore[union-attr]
        if self.subcommands:
            kinds = parser.add_subparsers(dest="kind", required=True)
            for command in self.subcommands:
                command.add(kinds)
        else:
            parser.set_defaults(run=self.run)


def given(args: argparse.Namespace, *left_out: str) -> dict[str, Any]:
    """The options the user gave (a `given_only` command's args hold no others), less the parser's own and
    `left_out`."""
    return {key: value for key, value in vars(args).items() if key not in ("run", "command", "kind", *left_out)}
