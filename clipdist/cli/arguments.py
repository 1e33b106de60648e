"""Argument types and helpers the subcommands share."""

from __future__ import annotations

import argparse


def csv(cast):
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
    return [0 if part.strip() == "auto" else int(part) for part in text.split(",")]


def batch_sizes(text: str) -> int | list[int]:
    sizes = csv(int)(text)
    return sizes[0] if len(sizes) == 1 else sizes
