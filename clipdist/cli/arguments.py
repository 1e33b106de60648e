"""Argument types and helpers the subcommands share. A number a command takes is bounded where it is parsed
(`number`, `count`, ...): argparse refuses a value outside in its own line, before anything runs. `command.arg`
refuses a bare int or float type, and `csv` a bare int or float cast, so no number slips past its bound."""

from __future__ import annotations

import argparse
import math

from clipdist.defaults import MAX_SEED


def number(cast: type, low: float, *, above: bool = False, high: float | None = None):
    """A number argument of type `cast` (int or float), finite, at least `low` (above it where `above`) and at most
    `high`: argparse's ArgumentTypeError says which bound a value misses."""
    bound = f"{'above' if above else 'at least'} {_shown(low)}"
    bound += "" if high is None else f" and at most {_shown(high)}"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if cast is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number, {bound}")
        if value < low or (above and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text}: must be {bound}")
        return value

    parse.bounds = (low, above, high)  # type: ignore[attr-defined]  # what tests/unit/test_bad_input.py probes
    return parse


def _shown(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


count = number(int, 1)  # a count of things: ranks, steps, samples, repeats
count_or_zero = number(int, 0)  # none allowed: loader workers, a tower's unlocked layer groups
positive = number(float, 0, above=True)  # a timeout in seconds, a device's TFLOPS
non_negative = number(float, 0)  # a budget in seconds (0: measure nothing)
seed = number(int, 0, high=MAX_SEED)  # what every generator a seed reaches takes


def file_stem(text: str) -> str:
    """The start of a file name a command writes (files.FILE_STEM): never a path."""
    from clipdist.files import FILE_STEM

    if not FILE_STEM.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a file name's start (letters, digits, '.', '_', '-'; not starting with '.' or '-')"
        )
    return text


def csv(cast):
    """A comma-separated list, each part parsed by `cast` (a bounded type, or str)."""
    if cast in (int, float):
        raise TypeError(f"csv({cast.__name__}) takes any number: give a bounded type (clipdist.cli.arguments.number)")
    return lambda text: [cast(part) for part in text.split(",")]


def one_of(names: tuple[str, ...]):
    """A comma-separated list of `names` (argparse says which part is none of them, and what is)."""

    def parse(text: str) -> list[str]:
        parts = [part.strip() for part in text.split(",")]
        unknown = [part for part in parts if part not in names]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(names)}")
        return parts

    return parse


def chunk_counts(text: str) -> list[int]:
    """--chunks: counts, or 'auto' (plan.AUTO, 0)."""
    return [0 if part.strip() == "auto" else count(part) for part in text.split(",")]


def batch_sizes(text: str) -> int | list[int]:
    sizes = csv(count)(text)
    return sizes[0] if len(sizes) == 1 else sizes
